"""Plain text, prompt/completion and chat data, read and tokenized through `datasets` (its fingerprint cache makes a
second run skip the tokenization). Each row is {id, input_ids, labels} with labels -100 on the tokens that carry
no loss; completion and chat rows also hold {prompt_ids, reference}: the prompt a held-out item is answered from
and the answer it is scored against.

- text: `.txt` (documents separated by blank lines) or JSONL {"text"}; every token is a target. Documents end with
  EOS and are packed back to back into `max_length` windows (no attention mask between documents, as
  transformers' run_clm packs); each window records its documents' pieces, so that `data.packing` can train on the
  same tokens with the documents kept apart (data/packing.py).
- completion: JSONL {"prompt", "completion"}; prompt and completion are tokenized separately and concatenated as
  written, so the mask boundary is exact; the completion ends with EOS.
- chat: JSONL {"messages": [{"role", "content"}, ...]}, rendered by the tokenizer's own chat template. The
  assistant turns are found as the characters a turn adds after the template's generation prompt, so the loss
  covers each assistant reply and the template's end-of-turn tokens, nothing of the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
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
    train = load_lm_split(data.train, data.format, tokenizer, data.max_length, data.on_bad_line)
    if data.eval is not None:
        held_out = load_lm_split(data.eval, data.format, tokenizer, data.max_length, data.on_bad_line)
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


def load_lm_split(path: str, fmt: str, tokenizer: Any, max_length: int, on_bad_line: str) -> LmSplit:
    """One file's rows; a bad line raises BadInput naming it, or is skipped and counted (on_bad_line: skip)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"data: {file} does not exist")
    if not file.read_bytes().strip():
        raise BadInput(f"{file}: the file is empty; {_EXPECTED[fmt]}")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise BadInput(
            "data.format: chat needs a tokenizer with a chat template; this model's tokenizer has none "
            "(use format completion, or a model whose tokenizer_config.json has chat_template)"
        )
    plain_text = fmt == "text" and file.suffix != ".jsonl"
    lines = datasets.load_dataset(
        "text", data_files=str(file), split="train", sample_by="paragraph" if plain_text else "line"
    )
    encoder = _Encoder(fmt, tokenizer, max_length, plain_text)
    encoded = lines.map(encoder, with_indices=True, remove_columns=["text"], desc=f"tokenizing {file.name}")
    problems = [(i + 1, p) for i, p in enumerate(encoded[_PROBLEM]) if p]
    if problems and on_bad_line == "error":
        line, reason = problems[0]
        where = "paragraph" if plain_text else "line"
        raise BadInput(f"{file}: {where} {line}: {reason}; fix it or set data.on_bad_line=skip")
    kept = encoded.filter(lambda row: row["input_ids"] is not None and not row[_PROBLEM])
    if len(kept) == 0:
        raise BadInput(f"{file}: no usable {fmt} example ({len(problems)} bad lines); {_EXPECTED[fmt]}")
    kept = kept.remove_columns(_PROBLEM)
    if fmt == "text":
        kept = kept.map(_Packer(max_length), batched=True, batch_size=None, remove_columns=kept.column_names)
    return LmSplit(kept.to_list(), problems)


_EXPECTED = {
    "text": 'expected plain text, or JSONL with {"text"} per line',
    "completion": 'expected JSONL with {"prompt", "completion"} per line',
    "chat": 'expected JSONL with {"messages": [{"role", "content"}, ...]} per line',
}


class _Encoder:
    """datasets.map function: one raw line -> a row, or a row whose `problem` says why the line is bad."""

    def __init__(self, fmt: str, tokenizer: Any, max_length: int, plain_text: bool):
        self.fmt, self.tokenizer, self.max_length, self.plain_text = fmt, tokenizer, max_length, plain_text

    def __call__(self, line: dict, index: int) -> dict:
        empty = {"id": None, "input_ids": None, "labels": None, "prompt_ids": None, "reference": None, _PROBLEM: None}
        raw = line["text"].strip()
        if not raw:
            return empty
        try:
            item = raw if self.plain_text else _parse(raw)
            row = getattr(self, f"_{self.fmt}")(item)
        except ValueError as err:
            return {**empty, _PROBLEM: str(err)}
        row_id = item.get("id") if isinstance(item, dict) else None
        return {**empty, **row, "id": str(row_id) if row_id is not None else str(index + 1)}

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, item) -> dict:
        text = item if isinstance(item, str) else _string(item, "text")
        ids = bos_ids(self.tokenizer) + self._ids(text) + [self.tokenizer.eos_token_id]
        return {"input_ids": ids, "labels": ids}

    def _completion(self, item: dict) -> dict:
        prompt = bos_ids(self.tokenizer) + self._ids(_string(item, "prompt"))
        target = self._ids(_string(item, "completion")) + [self.tokenizer.eos_token_id]
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
        messages = _messages(item)
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
        item = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(item, dict):
        raise ValueError("expected a JSON object")
    return item


def _string(item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'"{key}" must be a non-empty string')
    return value


def _messages(item: dict) -> list[dict]:
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"}')
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f'message {index} must be an object with string "role" and "content"')
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn, so nothing to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


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
