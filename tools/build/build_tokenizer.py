"""Train the offline byte-level BPE tokenizer (vocab 4096) and save it to configs/tokenizers/lcsb-bpe/.

Deterministic: the corpus comes from corpus_lines(seed) in tools/build/synthetic.py, the trainer runs
single-threaded, and two runs give byte-identical tokenizer.json.
Usage: python tools/build/build_tokenizer.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import os

# before tokenizers starts its thread pool
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from synthetic import corpus_lines  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|pad|>"]
# A plain-text chat layout (the vocabulary has no chat tokens): each turn ends with EOS, so a reply stops there.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train(lines: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "configs" / "tokenizers" / "lcsb-bpe")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train(corpus_lines(args.seed)),
        eos_token=SPECIAL[0],
        pad_token=SPECIAL[1],
        padding_side="right",
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(args.out)
    print(f"wrote {args.out} (vocab {len(fast)})")


if __name__ == "__main__":
    main()
