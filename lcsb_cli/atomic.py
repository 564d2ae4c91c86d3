"""Files and directories that appear whole or not at all: filled beside their target, synced, then renamed into
place. A write that fails (or is interrupted) leaves nothing behind and the old target untouched."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_dir(target: Path, write: Callable[[Path], None], replace: bool = False) -> bool:
    """Fill a temp dir beside `target` with `write(tmp)` and rename it to `target`.

    `target` may be missing or an empty dir; with `replace`, an existing `target` is swapped out and removed.
    Otherwise returns False when another process put a complete `target` there first (its copy is kept).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    old = target.with_name(f"{tmp.name}.old")
    try:
        # mkdtemp's 0700 would make the result private
        tmp.chmod(0o755)
        write(tmp)
        _fsync(tmp)
        swapped = target.is_dir() and (replace or not any(target.iterdir()))
        if swapped:
            target.rename(old)
        try:
            os.rename(tmp, target)
        except OSError:
            if swapped:
                # the old target is put back as it was
                old.rename(target)
                raise
            if target.is_dir():
                return False
            raise
        _fsync(target.parent)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_file(target: Path, write: Callable[[Path], None]) -> None:
    """Write a temp file beside `target` with `write(tmp)`, sync it, then rename it to `target` (replacing it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        _fsync(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    write_file(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
