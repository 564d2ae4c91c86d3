"""A nightly lineage's items: the records of one data file as the file holds them, for every format a night can
learn (phone labels, chat, completion, text, preference, feedback), each with its content hash, its timestamp and
its user.

A record's `timestamp` field (epoch seconds, ISO-8601, or a parquet/arrow timestamp) orders the items when every
record has one; phone labels (jsonl) always do. A file without timestamps keeps its own order, and its new items
are the records whose content hash the lineage has not seen. A file where only some records carry one is refused:
its order would be a guess."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .columns import Shape
from .files import JSON_LINES, PLAIN, read_source
from .personal import PersonalExample, load_personal, parse_timestamp

FORMATS = ("jsonl", "chat", "completion", "text", "preference", "feedback")
TIMESTAMP = "timestamp"


@dataclass(frozen=True)
class Record:
    row: dict
    hash: str
    # POSIX seconds, UTC; None in a file without timestamps
    timestamp: float | None
    user: str | None


@dataclass(frozen=True)
class Records:
    items: list[Record]
    # every record has a timestamp (the items are ordered by it), or none has
    timed: bool
    # phone labels' label set; None for the other formats
    labels: tuple[str, ...] | None


def read_records(data) -> Records:
    """The records of `data.train` (recipe's data section) in the file's order."""
    if data.format == "jsonl":
        personal = load_personal(data.train, data.on_bad_line, data.labels)
        return Records([personal_record(e) for e in personal.examples], True, personal.labels)
    if data.format not in FORMATS:
        raise BadInput(f"lcsb night: data.format is {data.format}; a lineage reads {', '.join(FORMATS)}")
    rows = _rows(Path(data.train), Shape.of(data.format, data.columns))
    items = [_record(row, number, data.train) for number, row in enumerate(rows, start=1)]
    timed = [item.timestamp is not None for item in items]
    if any(timed) and not all(timed):
        raise BadInput(
            f'{data.train}: {sum(timed)} of {len(items)} records have a "{TIMESTAMP}"; a lineage orders by time '
            "only when every record has one (or none does: then by the file's order and content)"
        )
    return Records(items, all(timed), None)


def json_lines(records: list[Record]) -> str:
    """The records as JSON lines, which every format above reads back."""
    return "".join(json.dumps(record.row, default=str) + "\n" for record in records)


def item_hash(example: PersonalExample) -> str:
    fields = [example.id, example.text, example.label, example.timestamp, example.user]
    return _digest(json.dumps(fields))


def personal_record(example: PersonalExample) -> Record:
    row = {"id": example.id, "text": example.text, "label": example.label, "timestamp": example.timestamp}
    return Record({**row, "user": example.user}, item_hash(example), example.timestamp, example.user)


def _rows(path: Path, shape: Shape) -> list[dict]:
    source = read_source(path, "data.train", shape)
    if source.kind == PLAIN:
        texts = (row["text"].strip() for row in source.rows)
        return [{shape.names["text"]: text} for text in texts if text]
    if source.kind != JSON_LINES:
        return source.rows.to_list()
    rows = []
    for number, row in enumerate(source.rows, start=1):
        if row["text"].strip():
            rows.append(_json_object(row["text"], path, number))
    return rows


def _json_object(raw: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(raw.lstrip("\ufeff"))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise BadInput(f"{path}: line {number}: expected a JSON object")
    return row


def _record(row: dict, number: int, path: Any) -> Record:
    stamp, user = row.get(TIMESTAMP), row.get("user")
    try:
        timestamp = None if stamp is None else parse_timestamp(stamp)
    except ValueError as err:
        raise BadInput(f"{path}: record {number}: {err}") from None
    if user is not None and not isinstance(user, str):
        raise BadInput(f'{path}: record {number}: "user" must be a string when given')
    return Record(row, _digest(json.dumps(row, sort_keys=True, default=str)), timestamp, user)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
