"""Plain text, prompt/completion and chat data, read and tokenized through `datasets` (its fingerprint cache makes a
second run skip the tokenization). Each row is {id, input_ids, labels} with labels -100 on the tokens that carry
no loss; completion and chat rows also hold {prompt_ids, reference}: the prompt a held-out item is answered from
and the answer it is scored against.

Files are read by data/files.py (JSONL, JSON, parquet, CSV, arrow, save_to_disk directories, plain text), records
by data/columns.py (data.columns, ShareGPT, Alpaca).

- text: `.txt` (documents separated by blank lines) or records {"text"}; every token is a target. Documents end with
  EOS and are packed back to back into `max_length` windows (no attention mask between documents, as
  transformers' run_clm packs); each window records its documents' pieces, so that `data.packing` can train on the
  same tokens with the documents kept apart (data/packing.py).
- completion: records {"prompt", "completion"}; prompt and completion are tokenized separately and concatenated as
  written, so the mask boundary is exact; the completion ends with EOS.
- chat: records {"messages": [{"role", "content"}, ...]}, rendered by the tokenizer's own chat template. The
  assistant turns are found as the characters a turn adds after the template's generation prompt, so the loss
  covers each assistant reply and the template's end-of-turn tokens, nothing of the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .columns import Shape
from .files import JSON_LINES, PLAIN, read_source
from .lamp2 import bos_ids
from .task import TaskData

# data.eval_fraction draws the same held-out items on every run, whatever train.seed is
SPLIT_SEED = 0
_PROBLEM = "problem"
# a text window: its tokens (every one a target) and its documents' pieces
WINDOW_COLUMNS = ("id", "input_ids", "labels", "segments")


@dataclass
class LmSplit:
    rows: list[dict]
    # (line number, reason) of lines skipped under data.on_bad_line: skip
    skipped: list[tuple[int, str]]


def load_lm_task(recipe, tokenizer: Any) -> TaskData:
    """A text, completion or chat run: `data.eval` is held out when given, else a seeded `data.eval_fraction` of
    `data.train` (the same items on every run)."""
    data = recipe.data
    options = {"columns": data.columns}
    train = load_lm_split(data.train, data.format, tokenizer, data.max_length, data.on_bad_line, **options)
    if data.eval is not None:
        held_out = load_lm_split(
            data.eval, data.format, tokenizer, data.max_length, data.on_bad_line, **options, key="data.eval"
        )
        return TaskData(data.format, train.rows, held_out.rows, None, train.skipped + held_out.skipped)
    if len(train.rows) < 2:
        raise BadInput(
            f"data.eval_fraction: {data.train} gives {len(train.rows)} example; a held-out split needs "
            "at least 2 (or give data.eval)"
        )
    order = _seeded_order(len(train.rows))
    held = set(order[: min(max(1, round(len(order) * data.eval_fraction)), len(order) - 1)])
    return TaskData(
        data.format,
        [r for i, r in enumerate(train.rows) if i not in held],
        [r for i, r in enumerate(train.rows) if i in held],
        None,
        train.skipped,
    )


def _seeded_order(n: int) -> list[int]:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()


def load_lm_split(
    path: str,
    fmt: str,
    tokenizer: Any,
    max_length: int,
    on_bad_line: str,
    columns: dict[str, str] | None = None,
    key: str = "data.train",
) -> LmSplit:
    """One file's rows; a bad line (or row) raises BadInput naming it, or is skipped and counted (on_bad_line: skip)."""
    shape = Shape.of(fmt, columns)
    file = Path(path)
    source = read_source(file, key, shape)
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise BadInput(
            "data.format: chat needs a tokenizer with a chat template; this model's tokenizer has none "
            "(use format completion, or a model whose tokenizer_config.json has chat_template)"
        )
    encoder = _Encoder(shape, source.kind, tokenizer, max_length)
    encoded = source.rows.map(
        encoder, with_indices=True, remove_columns=source.rows.column_names, desc=f"tokenizing {file.name}"
    )
    problems = [(i + 1, p) for i, p in enumerate(encoded[_PROBLEM]) if p]
    if problems and on_bad_line == "error":
        number, reason = problems[0]
        raise BadInput(f"{file}: {source.unit} {number}: {reason}; fix it or set data.on_bad_line=skip")
    kept = encoded.filter(lambda row: row["input_ids"] is not None and not row[_PROBLEM])
    if len(kept) == 0:
        raise BadInput(
            f"{file}: no usable {fmt} example ({len(problems)} bad {source.unit}s); format {fmt} reads "
            f"{shape.describe()}"
        )
    kept = kept.remove_columns(_PROBLEM)
    if fmt == "text":
        kept = kept.map(_Packer(max_length), batched=True, batch_size=None, remove_columns=kept.column_names)
    return LmSplit(kept.to_list(), problems)


class _Encoder:
    """datasets.map function: one paragraph, line or record -> a row, or a row whose `problem` says why it is bad."""

    def __init__(self, shape: Shape, kind: str, tokenizer: Any, max_length: int):
        self.shape, self.kind, self.tokenizer, self.max_length = shape, kind, tokenizer, max_length

    def __call__(self, row: dict, index: int) -> dict:
        empty = {"id": None, "input_ids": None, "labels": None, "prompt_ids": None, "reference": None, _PROBLEM: None}
        try:
            item = self._item(row)
            if item is None:
                return empty
            encoded = getattr(self, f"_{self.shape.format}")(item)
        except ValueError as err:
            return {**empty, _PROBLEM: str(err)}
        return {**empty, **encoded, "id": str(item["id"]) if item["id"] is not None else str(index + 1)}

    def _item(self, row: dict) -> dict | None:
        """The row's record as data/columns.py reads it; None for a blank line or paragraph."""
        if self.kind not in (PLAIN, JSON_LINES):
            return self.shape.item(row)
        raw = row["text"].strip()
        if not raw:
            return None
        return {"id": None, "text": raw} if self.kind == PLAIN else self.shape.item(_parse(raw))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, item: dict) -> dict:
        ids = bos_ids(self.tokenizer) + self._ids(item["text"]) + [self.tokenizer.eos_token_id]
        return {"input_ids": ids, "labels": ids}

    def _completion(self, item: dict) -> dict:
        prompt = bos_ids(self.tokenizer) + self._ids(item["prompt"])
        target = self._ids(item["completion"]) + [self.tokenizer.eos_token_id]
        if len(prompt) >= self.max_length:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens, which leaves no room for the completion within "
                f"data.max_length={self.max_length}; shorten it or raise data.max_length"
            )
        target = target[: self.max_length - len(prompt)]
        return {
            "input_ids": prompt + target,
            "labels": [-100] * len(prompt) + target,
            "prompt_ids": prompt,
            "reference": item["completion"].strip(),
        }

    def _chat(self, item: dict) -> dict:
        messages = item["messages"]
        text, spans = assistant_spans(self.tokenizer, messages)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])[: self.max_length]
        labels = [
            token if any(a <= start < b for a, b in spans) else -100
            for token, (start, _) in zip(ids, encoded["offset_mapping"])
        ]
        if all(label == -100 for label in labels):
            raise ValueError(
                f"no assistant token falls within data.max_length={self.max_length}; shorten the "
                "conversation or raise data.max_length"
            )
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return {
            "input_ids": ids,
            "labels": labels,
            "prompt_ids": chat_prompt(self.tokenizer, messages[:last]),
            "reference": messages[last]["content"].strip(),
        }


def _parse(raw: str) -> dict:
    try:
        item = json.loads(raw.lstrip("\ufeff"))
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(item, dict):
        raise ValueError("expected a JSON object")
    return item


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns: what rendering turn i adds after
    rendering the turns before it with the generation prompt."""
    text = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation as the sum of its turns, "
                "so the assistant turns cannot be located; use format completion"
            )
        spans.append((len(before), len(upto)))
    return text, spans


def chat_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt: what the model answers from."""
    return list(tokenizer(_render(tokenizer, messages, True), add_special_tokens=False)["input_ids"])


class _Packer:
    """datasets.map function (batched, one batch): documents back to back, cut into max_length windows. Each window
    keeps where its documents are: `segments` holds [document, offset in it, length] of each piece inside it, which
    data.packing (data/packing.py) reads to rebuild the documents."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        # datasets' cache key hashes this instance's attributes but not its class's code: the columns it writes
        # are here so that a cache written with other columns is not read back
        self.columns = WINDOW_COLUMNS

    def __call__(self, batch: dict) -> dict:
        stream = [token for ids in batch["input_ids"] for token in ids]
        windows = [stream[i : i + self.max_length] for i in range(0, len(stream), self.max_length)]
        segments = window_segments(map(len, batch["input_ids"]), self.max_length)
        kept = [(w, s) for w, s in zip(windows, segments) if len(w) > 1]
        ids = [w for w, _ in kept]
        values = ([f"window-{i}" for i in range(len(kept))], ids, ids, [s for _, s in kept])
        return dict(zip(self.columns, values, strict=True))


def window_segments(lengths, max_length: int) -> list[list[list[int]]]:
    """For documents of `lengths` back to back, cut into windows of max_length: per window, [document, offset in
    it, length] of each document piece inside it."""
    windows, current, room = [], [], max_length
    for document, length in enumerate(lengths):
        offset = 0
        while offset < length:
            take = min(room, length - offset)
            current.append([document, offset, take])
            offset, room = offset + take, room - take
            if room == 0:
                windows.append(current)
                current, room = [], max_length
    if current:
        windows.append(current)
    return windows
