"""Directories that appear whole or not at all: filled beside their target, then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def write_dir(target: Path, write: Callable[[Path], None]) -> bool:
    """Fill a temp dir beside `target` with `write(tmp)` and rename it to `target` (which may be an empty dir).

    A failed `write` leaves nothing behind. Returns False when another process put a complete `target` there
    first; its copy is kept.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would make the result private
        write(tmp)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        try:
            os.rename(tmp, target)
        except OSError:
            if target.is_dir():
                return False
            raise
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file(target: Path, write: Callable[[Path], None]) -> None:
    """Write a temp file beside `target` with `write(tmp)`, then rename it to `target`; a failed write leaves nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
