"""Preference data, in TRL's dataset conventions, so a user's files load unchanged:

- preference (dpo, orpo): records {"prompt", "chosen", "rejected"}, each a string (standard) or a list of
  {"role", "content"} (conversational: the prompt the turns before, chosen and rejected the assistant's reply);
- feedback (kto, unpaired): records {"prompt", "completion", "label": true | false}, strings or chat lists as above.

Files are read by data/files.py (JSONL, JSON, parquet, CSV, arrow, save_to_disk). A conversational record is
rendered with the tokenizer's chat template: the prompt with the generation prompt, the response as what the whole
conversation adds after it. The response keeps EOS (standard) or the template's end of turn, and is never cut: a
prompt too long for `data.max_length` loses its oldest tokens (the same for chosen and rejected). Each row keeps
`index`, its place in its split, which names its reference log-probs (objectives/reference.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput
from .batching import collate
from .columns import Shape
from .files import JSON_LINES, read_source
from .lamp2 import bos_ids
from .lm import _parse, _seeded_order
from .task import TaskData

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def load_preference_task(recipe, tokenizer: Any) -> TaskData:
    """A preference or feedback run: `data.eval` is held out when given, else a seeded `data.eval_fraction` of
    `data.train` (the same items on every run)."""
    data = recipe.data
    train, skipped = read_split(Path(data.train), "data.train", data.format, tokenizer, data)
    if data.format == "feedback":
        check_feedback_labels(train, recipe.objective)
    if data.eval is not None:
        held_out, more = read_split(Path(data.eval), "data.eval", data.format, tokenizer, data)
        return TaskData(data.format, indexed(train), indexed(held_out), None, skipped + more)
    if len(train) < 2:
        raise BadInput(f"data.eval_fraction: {data.train} gives {len(train)} example; a held-out split needs 2")
    order = _seeded_order(len(train))
    held = set(order[: min(max(1, round(len(order) * data.eval_fraction)), len(order) - 1)])
    kept = [row for i, row in enumerate(train) if i not in held]
    return TaskData(
        data.format, indexed(kept), indexed([row for i, row in enumerate(train) if i in held]), None, skipped
    )


def check_feedback_labels(rows: list[dict], objective: str) -> None:
    """kto needs both kinds of example: its loss pushes desirable up and undesirable down from one reference point."""
    desirable = sum(bool(row["label"]) for row in rows)
    if objective == "kto" and desirable in (0, len(rows)):
        kind = "true" if desirable else "false"
        raise BadInput(
            f"data.train: all {len(rows)} feedback labels are {kind}; kto needs both desirable (true) and "
            "undesirable (false) examples"
        )


def indexed(rows: list[dict]) -> list[dict]:
    """Each row's place in its split; a feedback row also takes the previous row's completion as its mismatched
    pair for KTO's KL estimate (TRL pairs a prompt with another example's completion the same way)."""
    out = [{**row, "index": i} for i, row in enumerate(rows)]
    for i, row in enumerate(out):
        if "completion_ids" in row:
            row["kl_completion_ids"] = out[i - 1]["completion_ids"]
    return out


def read_split(path: Path, key: str, fmt: str, tokenizer: Any, data) -> tuple[list[dict], list[tuple[int, str]]]:
    source = read_source(path, key, Shape.of(fmt))
    encode = partial(encode_pair if fmt == "preference" else encode_feedback, tokenizer, data.max_length)
    rows, skipped = [], []
    for number, raw in enumerate(source.rows, start=1):
        try:
            record = _parse(raw["text"]) if source.kind == JSON_LINES else raw
            rows.append({"id": str(record.get("id") or number), **encode(record)})
        except ValueError as err:
            if data.on_bad_line == "error":
                raise BadInput(f"{path}: {source.unit} {number}: {err}; fix it or set data.on_bad_line=skip") from None
            skipped.append((number, str(err)))
    if not rows:
        raise BadInput(f"{path}: no usable {fmt} example ({len(skipped)} bad {source.unit}s)")
    return rows, skipped


def encode_pair(tokenizer: Any, max_length: int, record: dict) -> dict:
    chosen, rejected = _field(record, "chosen"), _field(record, "rejected")
    if chosen == rejected:
        raise ValueError('"chosen" equals "rejected": the pair prefers nothing')
    prompt = record.get("prompt", "")
    prompt_ids, chosen_ids = render(tokenizer, prompt, chosen)
    rejected_ids = render(tokenizer, prompt, rejected)[1]
    longest = _fits(max_length, chosen=chosen_ids, rejected=rejected_ids)
    return {"prompt_ids": prompt_ids[-(max_length - longest) :], "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}


def encode_feedback(tokenizer: Any, max_length: int, record: dict) -> dict:
    completion = _field(record, "completion")
    prompt_ids, completion_ids = render(tokenizer, record.get("prompt", ""), completion)
    longest = _fits(max_length, completion=completion_ids)
    return {
        "prompt_ids": prompt_ids[-(max_length - longest) :],
        "completion_ids": completion_ids,
        "label": _label(record.get("label")),
    }


def render(tokenizer: Any, prompt, response) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids): strings tokenized apart (BOS before the prompt, EOS after the response), or a
    conversation rendered by the chat template and split where the generation prompt ends."""
    if isinstance(response, str) and isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        reply = tokenizer(response, add_special_tokens=False)["input_ids"]
        return bos_ids(tokenizer) + list(ids), list(reply) + [tokenizer.eos_token_id]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a conversational record needs a tokenizer with a chat template; this one has none")
    turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + (
        [{"role": "assistant", "content": response}] if isinstance(response, str) else response
    )
    before = tokenizer.apply_chat_template(
        turns[: -len(_as_list(response))], tokenize=False, add_generation_prompt=True
    )
    whole = tokenizer.apply_chat_template(turns, tokenize=False)
    if not whole.startswith(before):
        raise ValueError("the chat template does not render the reply after the prompt, so it cannot be located")
    encode = partial(tokenizer, add_special_tokens=False)
    return list(encode(before)["input_ids"]), list(encode(whole[len(before) :])["input_ids"])


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _field(record: dict, name: str):
    value = record.get(name)
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(_is_turn(turn) for turn in value):
        return value
    found = "" if name in record else f" (the record has {', '.join(map(str, record)) or 'no key'})"
    raise ValueError(f'"{name}" must be a non-empty string or a list of {{"role", "content"}}{found}')


def _is_turn(turn) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)


def _label(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f'"label" must be true or false, got {value!r}')


def _fits(max_length: int, **responses: list[int]) -> int:
    """The longest response's length; one that leaves no room for a prompt token within max_length is refused."""
    for name, ids in responses.items():
        if len(ids) >= max_length:
            raise ValueError(
                f"the {name} response is {len(ids)} tokens, which does not fit data.max_length={max_length} with "
                "its prompt; responses are never cut: raise data.max_length or shorten it"
            )
    return max(len(ids) for ids in responses.values())


def joined(prompt_ids: list[int], response_ids: list[int], max_length: int) -> dict:
    """One sequence: the prompt's newest tokens, then the whole response, the only targets."""
    prompt = (
        prompt_ids[-(max_length - len(response_ids)) :]
        if len(prompt_ids) + len(response_ids) > max_length
        else prompt_ids
    )
    return {"input_ids": prompt + response_ids, "labels": [-100] * len(prompt) + response_ids}


def collate_pairs(rows: list[dict], pad_id: int, max_length: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """The chosen sequences, then the rejected ones, in one batch; `index` names each pair."""
    sequences = [joined(row["prompt_ids"], row[k], max_length) for k in ("chosen_ids", "rejected_ids") for row in rows]
    return {**collate(sequences, pad_id, multiple), "index": torch.tensor([row["index"] for row in rows])}


def collate_feedback(rows: list[dict], pad_id: int, max_length: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Each prompt with its completion, and (under kl_) with the previous row's completion for the KL estimate."""
    own = collate([joined(row["prompt_ids"], row["completion_ids"], max_length) for row in rows], pad_id, multiple)
    kl = collate([joined(row["prompt_ids"], row["kl_completion_ids"], max_length) for row in rows], pad_id, multiple)
    return {
        **own,
        **{f"kl_{name}": value for name, value in kl.items()},
        "index": torch.tensor([row["index"] for row in rows]),
        "label": torch.tensor([bool(row["label"]) for row in rows]),
    }
