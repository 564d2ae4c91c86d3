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

from ..errors import BadInput
from .columns import Shape
from .files import JSON_LINES, PLAIN, read_source
from .lm import _parse
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
    items = _records(Path(data.train), Shape.of(data.format, data.columns), data.on_bad_line)
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


def _records(path: Path, shape: Shape, on_bad_line: str) -> list[Record]:
    """Each row's record; a line that is not a JSON object or has a bad timestamp or user raises BadInput naming it,
    or is left out (on_bad_line: skip), as the night's run would leave it out."""
    source = read_source(path, "data.train", shape)
    records = []
    for number, row in enumerate(source.rows, start=1):
        if source.kind in (PLAIN, JSON_LINES) and not row["text"].strip():
            continue
        try:
            records.append(_record(_row(row, source.kind, shape)))
        except ValueError as err:
            if on_bad_line == "error":
                raise BadInput(f"{path}: {source.unit} {number}: {err}; fix it or set data.on_bad_line=skip") from None
    return records


def _row(row: dict, kind: str, shape: Shape) -> dict:
    if kind == PLAIN:
        return {shape.names["text"]: row["text"].strip()}
    return _parse(row["text"]) if kind == JSON_LINES else row


def _record(row: dict) -> Record:
    stamp, user = row.get(TIMESTAMP), row.get("user")
    timestamp = None if stamp is None else parse_timestamp(stamp)
    if user is not None and not isinstance(user, str):
        raise ValueError('"user" must be a string when given')
    return Record(row, _digest(json.dumps(row, sort_keys=True, default=str)), timestamp, user)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]
