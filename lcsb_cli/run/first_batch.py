"""Why a first batch scores worse than a uniform guess (hooks.check_initial_loss): a sound base that does not know
the text, or a broken model.

The tell is the model's loss on the shipped movie sample, plain English that lamp-tiny was built on and any real
base reads: a sound model scores it far below ln(vocab_size), a broken one (weights scrambled, a checkpoint saved
beside another tokenizer's vocabulary) about as badly as the data. lamp-tiny's byte-level tokenizer has no unknown
token: a word outside its vocabulary comes out in pieces (`reply` -> `re`, `pl`, `y`), so the share of the batch's
words spelt in several tokens (or as an unknown token) says how much of the text the vocabulary covers.
"""

from __future__ import annotations

import math
import re

import torch

from ..data.personal import load_personal
from ..paths import RECIPES_DIR

SAMPLE = RECIPES_DIR / "data" / "personal" / "movies.jsonl"
SAMPLE_ITEMS = 8
# a run of letters (numbers are spelt digit by digit by many vocabularies, real ones included)
WORD = re.compile(r"[^\W\d_]+")


def sample_batch(tokenizer) -> dict[str, torch.Tensor]:
    """The first items of the shipped movie sample, tokenized as one padded batch."""
    texts = [example.text for example in load_personal(SAMPLE).examples[:SAMPLE_ITEMS]]
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def batch_texts(tokenizer, batch: dict[str, torch.Tensor]) -> list[str]:
    """The text of each row of a token batch, padding and special tokens left out."""
    rows = [ids[mask.bool()] for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def unknown_words(tokenizer, texts: list[str]) -> tuple[int, int]:
    """(words the vocabulary lacks, words) in `texts`: a word is lacking when the tokenizer spells it in several
    tokens (byte or sub-word pieces) or as its unknown token. (0, 0) for a tokenizer without offsets (not fast)."""
    if not tokenizer.is_fast:
        return 0, 0
    encoded = tokenizer(texts, add_special_tokens=False)
    lacking = words = 0
    for row, text in enumerate(texts):
        for word in WORD.finditer(text):
            first, last = encoded.char_to_token(row, word.start()), encoded.char_to_token(row, word.end() - 1)
            words += 1
            lacking += first is None or first != last or encoded["input_ids"][row][first] == tokenizer.unk_token_id
    return lacking, words


def first_batch_problem(name: str, vocab: int, loss: float, sample_loss: float, unknown_share: float | None) -> str:
    """The one-line error for a first-batch loss above ln(vocab_size) + 1: a base that does not know the text when
    it scores the shipped sample at least 1 nat better than a uniform guess, else a broken model."""
    bound, off = math.log(vocab) + 1, "train.check_initial_loss=false"
    above = f"its loss on the first batch, {loss:.2f}, is above ln(vocab_size) + 1 = {bound:.2f}"
    if sample_loss > math.log(vocab) - 1:
        return (
            f"model.name: the model is broken: {above}, worse than a uniform guess over its {vocab:,} tokens, and "
            f"{sample_loss:.2f} on the shipped movie sample, which a sound base reads (set {off} to train it anyway)"
        )
    lacking = "" if unknown_share is None else f"; {unknown_share:.0%} of the batch's words are not in its vocabulary"
    return (
        f"model.name: {name} does not know this text: {above}, worse than a uniform guess, yet {sample_loss:.2f} on "
        f"the shipped movie sample, so the model is sound{lacking}. Train on a base that reads your text: "
        f"model.name=smollm2-135m, as recipes/overnight-smollm2.yaml does (or set {off} to train this one anyway)"
    )
