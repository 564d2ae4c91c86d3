"""Atomic checkpoints: a temp dir filled, a manifest of checksums written last, then one rename (atomic.py)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import write_dir, write_json_atomic
from ..errors import BadInput

# torch loads when a checkpoint is written or read, not for `lcsb validate` or a refused run
if TYPE_CHECKING:
    import torch

ADAPTER_FILE = "adapter_model.safetensors"
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"


def checkpoint_dirs(root: Path) -> list[Path]:
    """Finished checkpoints under `root` (a run's checkpoints/), newest first."""
    found = (
        [p for p in root.glob("step-*") if step_of(p) is not None and (p / MANIFEST).is_file()] if root.is_dir() else []
    )
    return sorted(found, key=step_of, reverse=True)


def step_of(path: Path) -> int | None:
    """The step of a `step-N` checkpoint dir; None for any other name (step-6.bak, step-latest)."""
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else None


def save_checkpoint(root: Path, step: int, adapter: dict[str, torch.Tensor], state: dict, keep: int) -> Path:
    import torch
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, tmp / ADAPTER_FILE)
        torch.save(state, tmp / STATE_FILE)
        files = {name: _sha256(tmp / name) for name in (ADAPTER_FILE, STATE_FILE)}
        write_json_atomic(tmp / MANIFEST, {"step": step, "files": files})

    final = root / f"step-{step}"
    write_dir(final, fill, replace=True)
    for old in checkpoint_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest (a crash or disk error damaged it)."""


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Adapter tensors and state, after checking every file against the manifest's checksums.

    The state is read with `weights_only=True`: tensors and plain containers, never code from the file.
    """
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"its files entry is {type(files).__name__}, not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"{path / MANIFEST} is unreadable: {exc}") from exc
    for name in (ADAPTER_FILE, STATE_FILE):
        if name not in files or not (path / name).is_file() or _sha256(path / name) != files[name]:
            raise CorruptCheckpoint(f"{path / name} does not match the checksum in its manifest")
    import torch
    from safetensors.torch import load_file

    try:
        state = torch.load(path / STATE_FILE, weights_only=True, map_location="cpu")
    # torch raises UnpicklingError for anything but plain data
    except Exception as exc:
        raise BadInput(f"{path / STATE_FILE}: refused to load (not plain tensors/containers): {exc}") from exc
    return load_file(path / ADAPTER_FILE), state


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
