"""The metrics log (metrics.jsonl): one JSON row per line, read back past a line a kill cut short."""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import write_text_atomic


def truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep the complete rows up to `last_step` (a killed run may have logged past its last checkpoint)."""
    rows = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return rows


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            # a line cut short by a kill
            except json.JSONDecodeError:
                continue
    return rows
