"""A data file read through `datasets` by what it is, not by its name: parquet ("PAR1"), arrow IPC (a file,
"ARROW1", or a stream, as save_to_disk writes), a save_to_disk directory (dataset_info.json, state.json), JSON (a
document that starts with [ or {, or one object a line), CSV (a .csv / .tsv file, or a first line that names the
format's columns), else plain text. A .txt file is plain text for the text format. Any format that reads records
reads its files here; a file that does not fit the format is refused in one line naming what it is and what fits."""

from __future__ import annotations

import codecs
import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .columns import Shape

ACCEPTED = "JSONL, JSON, parquet, CSV, arrow or a datasets save_to_disk directory"
HEAD_BYTES = 1 << 16
MAGIC = ((b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\xff\xff\xff\xff", "arrow"))
# what messages call a file a datasets builder reads
KINDS = {"parquet": "a parquet file", "arrow": "an arrow file", "csv": "a CSV file", "json": "a JSON document"}
DISK_MARKERS = ("dataset_info.json", "state.json")
CSV_DELIMITERS = {".csv": ",", ".tsv": "\t"}
PLAIN, JSON_LINES = "plain text", "JSON lines"


@dataclass(frozen=True)
class Source:
    """A file's rows (a datasets.Dataset), what the file is, and what a row is called in messages. Plain text and
    JSON lines hold each paragraph or line raw in a "text" column, so that a bad one is named by its number; the
    other kinds hold records."""

    kind: str
    unit: str
    rows: Any


def read_source(path: Path, key: str, shape: Shape) -> Source:
    """The rows of `path` (named by recipe `key` in messages), as `shape`'s format reads them."""
    if path.is_dir():
        return _fitting(Source("a save_to_disk directory", "row", _from_disk(path, key)), path, key, shape)
    if not path.is_file():
        raise BadInput(f"{key}: {path} does not exist")
    with path.open("rb") as file:
        head = file.read(HEAD_BYTES)
    for magic, builder in MAGIC:
        if head.startswith(magic):
            return _fitting(Source(KINDS[builder], "row", _load(builder, path, key)), path, key, shape)
    text = _text_head(path, head, key, shape).lstrip("\ufeff \t\r\n")
    if not text and not path.read_bytes().strip():
        raise BadInput(f"{path}: the file is empty; format {shape.format} reads {shape.describe()}")
    if shape.plain_text and path.suffix.lower() == ".txt":
        return Source(PLAIN, "paragraph", _load("text", path, key, sample_by="paragraph"))
    if text.startswith(("[", "{")):
        return _json(path, key, shape, text)
    delimiter = _csv_delimiter(path, text.partition("\n")[0], shape)
    if delimiter is not None:
        return _fitting(Source(KINDS["csv"], "row", _csv(path, key, delimiter)), path, key, shape)
    if not shape.plain_text:
        raise BadInput(f"{key}: {path} is plain text; format {shape.format} reads {shape.describe()} ({ACCEPTED})")
    return Source(PLAIN, "paragraph", _load("text", path, key, sample_by="paragraph"))


def _fitting(source: Source, path: Path, key: str, shape: Shape) -> Source:
    """A file of records whose columns the format reads, else one line naming them."""
    columns = source.rows.column_names
    if not shape.fits(columns):
        raise BadInput(
            f"{key}: {path} is {source.kind} with columns {', '.join(columns) or 'none'}, which format "
            f"{shape.format} does not read; it reads {shape.describe()} ({ACCEPTED}); name yours with data.columns"
        )
    if len(source.rows) == 0:
        raise BadInput(f"{key}: {path} is {source.kind} with no rows")
    return source


def _json(path: Path, key: str, shape: Shape, text: str) -> Source:
    """One object a line (JSON lines, read line by line), or one document: a list of records, or one record."""
    if text.startswith("{") and (_is_json(text.partition("\n")[0]) or not _is_json(path.read_text("utf-8"))):
        return Source(JSON_LINES, "line", _load("text", path, key, sample_by="line"))
    return _fitting(Source(KINDS["json"], "item", _load("json", path, key)), path, key, shape)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _csv_delimiter(path: Path, first_line: str, shape: Shape) -> str | None:
    """CSV: by its suffix, or a first line that is a header naming the columns of one of the format's layouts."""
    if path.suffix.lower() in CSV_DELIMITERS:
        return CSV_DELIMITERS[path.suffix.lower()]
    for delimiter in ("\t", ","):
        if shape.fits(name.strip() for name in next(csv.reader([first_line], delimiter=delimiter), [])):
            return delimiter
    return None


def _csv(path: Path, key: str, delimiter: str):
    """Every column read as a string (an id stays "007"), an empty cell as ""."""
    import datasets

    with path.open(encoding="utf-8-sig", newline="") as file:
        header = next(csv.reader(file, delimiter=delimiter), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return _load("csv", path, key, delimiter=delimiter, features=features, keep_default_na=False)


def _text_head(path: Path, head: bytes, key: str, shape: Shape) -> str:
    """The file's first bytes as text; a binary file (a NUL byte, or not UTF-8) is refused."""
    try:
        if b"\x00" in head:
            raise UnicodeDecodeError("utf-8", head, 0, 1, "a NUL byte")
        return codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        raise BadInput(
            f"{key}: {path} is a binary file lcsb does not read; format {shape.format} reads {shape.describe()} "
            f"({ACCEPTED})"
        ) from None


def _from_disk(path: Path, key: str):
    """A save_to_disk directory, held in memory (datasets would write its map caches into the user's directory)."""
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        example = "train" if "train" in splits else splits[0]
        raise BadInput(
            f"{key}: {path} holds several splits ({', '.join(splits)}); point at one, e.g. {key}={path / example}"
        )
    if not any((path / marker).is_file() for marker in DISK_MARKERS):
        raise BadInput(
            f"{key}: {path} is a directory without {' or '.join(DISK_MARKERS)}, not a datasets save_to_disk "
            "directory; give a data file or such a directory"
        )
    return _read(lambda: datasets.load_from_disk(str(path), keep_in_memory=True), path, key, "a save_to_disk directory")


def _load(builder: str, path: Path, key: str, **options):
    import datasets

    return _read(
        lambda: datasets.load_dataset(builder, data_files=str(path), split="train", **options),
        path,
        key,
        KINDS.get(builder, builder),
    )


def _read(load, path: Path, key: str, kind: str):
    """`load()`, a damaged file refused in one line with the library's reason."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        return load()
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, KeyError) as err:
        reason = str(err.__cause__ or err).strip().splitlines() or [type(err).__name__]
        raise BadInput(f"{key}: {path} cannot be read as {kind}: {reason[0][:200]}") from None
