"""Phone-collected labels for overnight personalization: load a JSONL file, split it by time, make questions.

One example per line: {"id", "text", "label", "timestamp"} and an optional "user". The timestamp is epoch
seconds or an ISO-8601 string (naive means UTC, a trailing "Z" is accepted). Examples become LaMP-2 style
questions (`tags: [...] description: ...`), so lamp2's prompt encoder and evaluator work on them unchanged.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .lamp2 import LampQuestion
from .task import TaskData

PROMPT = "Which category does this item belong to among the following categories? Just answer with the category name."
ON_BAD_LINE = ("error", "skip")
# would break the `tags: [a, b]` list
_LABEL_BREAKERS = (",", "[", "]")


@dataclass(frozen=True)
class PersonalExample:
    id: str
    text: str
    label: str
    # POSIX seconds, UTC
    timestamp: float
    user: str | None
    # 1-based line in the source file
    line: int


@dataclass(frozen=True)
class PersonalData:
    examples: list[PersonalExample]
    # (1-based line, reason)
    skipped: list[tuple[int, str]]
    labels: tuple[str, ...]


def format_personal_input(labels: Sequence[str], text: str) -> str:
    """The question text: the prompt, the category list and the item (lamp2.split_input reads it back)."""
    return f"{PROMPT} tags: [{', '.join(labels)}] description: {text}"


def _label_problem(label: str) -> str | None:
    if any(ch in label for ch in _LABEL_BREAKERS):
        return f"label {label!r} contains one of {' '.join(_LABEL_BREAKERS)}, which the category list cannot hold"
    return None


def parse_timestamp(value: Any) -> float:
    """POSIX seconds (UTC) from a number, an ISO-8601 string or a datetime (a parquet or arrow timestamp column);
    ValueError with the reason otherwise."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"timestamp {value!r} is not a finite number")
        return float(value)
    if not isinstance(value, str):
        raise ValueError('"timestamp" must be epoch seconds or an ISO-8601 string')
    text = value.strip()
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise ValueError(f"timestamp {value!r} is not ISO-8601 (e.g. 2026-11-16T08:12:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _field(item: dict, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'"{name}" must be a non-empty string')
    return value.strip()


def _parse_line(raw: str, line: int, labels: Sequence[str] | None) -> PersonalExample:
    """One example from one JSONL line; ValueError with the reason if the line is bad."""
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(item, dict):
        raise ValueError('expected a JSON object with "id", "text", "label" and "timestamp"')
    example_id, text, label = _field(item, "id"), _field(item, "text"), _field(item, "label")
    if labels is not None and label not in labels:
        raise ValueError(f"label {label!r} is not one of the recipe's labels ({', '.join(labels)})")
    problem = _label_problem(label)
    if problem:
        raise ValueError(problem)
    if "timestamp" not in item:
        raise ValueError('"timestamp" is missing')
    timestamp = parse_timestamp(item["timestamp"])
    user = item.get("user")
    if user is not None and not isinstance(user, str):
        raise ValueError('"user" must be a string when given')
    return PersonalExample(example_id, text, label, timestamp, user, line)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise BadInput(f"{path}: file not found; check data.path in the recipe") from None
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: cannot be read as UTF-8 text ({err}); point the recipe at a JSONL file") from None


def _check_labels(labels: Sequence[str], where: str) -> tuple[str, ...]:
    if isinstance(labels, str) or not all(isinstance(label, str) and label.strip() for label in labels):
        raise BadInput(f"{where}: labels must be a list of non-empty strings")
    result = tuple(label.strip() for label in labels)
    if len(set(result)) != len(result):
        raise BadInput(f"{where}: labels repeat a name; list each label once")
    for label in result:
        if _label_problem(label):
            raise BadInput(f"{where}: {_label_problem(label)}; rename it")
    if len(result) < 2:
        raise BadInput(f"{where}: need at least 2 labels to classify, got {len(result)}: {', '.join(result) or 'none'}")
    return result


def load_personal(path: str | Path, on_bad_line: str = "error", labels: Sequence[str] | None = None) -> PersonalData:
    """Examples of a JSONL file; a bad line raises BadInput ("error") or is recorded in `skipped` ("skip").

    `labels` (from the recipe) fixes the label set and order; without it the sorted labels of the valid
    examples are used. Blank lines are ignored; a repeated id makes the later line bad.
    """
    path = Path(path)
    if on_bad_line not in ON_BAD_LINE:
        raise BadInput(f"data.on_bad_line is {on_bad_line!r}; use one of: {', '.join(ON_BAD_LINE)}")
    given = None if labels is None else _check_labels(labels, f"{path}: recipe labels")
    examples: list[PersonalExample] = []
    skipped: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(_read_lines(path), start=1):
        if not raw.strip():
            continue
        try:
            example = _parse_line(raw, number, given)
            if example.id in seen:
                raise ValueError(f"id {example.id!r} already used on line {seen[example.id]}; ids must be unique")
        except ValueError as err:
            if on_bad_line == "error":
                raise BadInput(f"{path}: line {number}: {err}; fix the line or set data.on_bad_line=skip") from None
            skipped.append((number, str(err)))
            continue
        seen[example.id] = number
        examples.append(example)
    if not examples:
        raise BadInput(
            f"{path}: no valid example ({len(skipped)} bad lines skipped); expected JSONL with "
            '{"id", "text", "label", "timestamp"} per line'
        )
    final = given if given is not None else _check_labels(sorted({e.label for e in examples}), f"{path}: labels found")
    return PersonalData(examples, skipped, final)


def time_split(
    examples: Sequence[PersonalExample], eval_fraction: float
) -> tuple[list[PersonalExample], list[PersonalExample]]:
    """(train, eval): the newest ceil(n * eval_fraction) examples are eval, ordered by (timestamp, id).

    Examples sharing the boundary timestamp all go to eval (so eval may be a little larger than asked),
    which guarantees every training example is strictly older than every eval example.
    """
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
        raise BadInput(f"eval fraction {eval_fraction!r} must be a number strictly between 0 and 1, e.g. 0.2")
    if len(examples) < 2:
        raise BadInput(f"a time split needs at least 2 examples, got {len(examples)}; collect more labels first")
    ordered = sorted(examples, key=lambda e: (e.timestamp, e.id))
    n_eval = min(max(1, math.ceil(round(len(ordered) * eval_fraction, 9))), len(ordered) - 1)
    cut = bisect_left([e.timestamp for e in ordered], ordered[len(ordered) - n_eval].timestamp)
    if cut == 0:
        raise BadInput(
            f"the newest {n_eval} examples share their timestamp with all older ones, so no example is "
            "strictly older than the eval set; check the timestamps or lower the eval fraction"
        )
    return ordered[:cut], ordered[cut:]


def filter_user(examples: Sequence[PersonalExample], user: str) -> list[PersonalExample]:
    """The examples of one user (as written in the file's "user" field)."""
    return [e for e in examples if e.user == user]


def to_questions(examples: Sequence[PersonalExample], labels: Sequence[str]) -> list[LampQuestion]:
    """LaMP-2 style questions over `labels`, with the example's label as the gold output."""
    return [
        LampQuestion(id=e.id, input=format_personal_input(labels, e.text), profile=(), user_id=e.user, output=e.label)
        for e in examples
    ]


def load_personal_task(recipe, tokenizer=None) -> TaskData:
    """A jsonl run: `data.eval` (another file of the same shape) is held out when given, else the newest
    `data.eval_fraction` of `data.train`; with `data.user`, that user's lines of both."""
    data = recipe.data
    train = _personal_file("data.train", data.train, data)
    if data.eval is None:
        older, newest = time_split(_of_user(train.examples, data.user, data.train), data.eval_fraction)
        return TaskData(
            "jsonl", to_questions(older, train.labels), to_questions(newest, train.labels), train.labels, train.skipped
        )
    held_out = _personal_file("data.eval", data.eval, data, train.labels)
    train_examples = _of_user(train.examples, data.user, data.train)
    held_examples = _of_user(held_out.examples, data.user, data.eval)
    return TaskData(
        "jsonl",
        to_questions(train_examples, train.labels),
        to_questions(held_examples, train.labels),
        train.labels,
        train.skipped + held_out.skipped,
    )


def _personal_file(key: str, path: str, data, labels: Sequence[str] | None = None) -> PersonalData:
    """One JSONL file; the held-out file is read over the training file's label set."""
    if not Path(path).is_file():
        raise BadInput(f"{key}: {path} does not exist")
    return load_personal(path, data.on_bad_line, labels if labels is not None else data.labels)


def _of_user(examples: Sequence[PersonalExample], user: str | None, path: str) -> list[PersonalExample]:
    chosen = list(examples) if user is None else filter_user(examples, user)
    if not chosen:
        raise BadInput(f"data.user: no items of user {user!r} in {path}")
    return chosen
