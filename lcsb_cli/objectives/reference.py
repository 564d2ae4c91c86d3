"""The reference log-probabilities DPO and KTO compare against: the same model with its adapter switched off
(peft's `disable_adapter`), so no second copy of the weights. A run that starts from an adapter (lora.init) takes
that starting adapter as its reference, with the adapter on, before the first update. Computed once per training
example before step 1, kept with the run (reference.safetensors) and read back by --resume, never recomputed.

The table is [examples, 2]: a pair's chosen and rejected response, or a feedback example's completion and its
mismatched (KL) completion."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import BadInput
from ..model.load import inference_mode

REFERENCE_FILE = "reference.safetensors"


@contextlib.contextmanager
def no_progress(what: str, n: int):
    yield lambda done: None


def compute_reference(
    model: torch.nn.Module,
    logps_of: Callable[[torch.nn.Module, dict], torch.Tensor],
    batches: list[dict],
    examples: int,
    use_base: bool,
    phase=no_progress,
) -> torch.Tensor:
    """[examples, 2] float32 log-probs of every batch's examples (each batch names its rows by `index`), in eval mode
    without gradients (`inference_mode`, which keeps bitsandbytes from repacking 4-bit weights for inference)."""
    table = torch.full((examples, 2), float("nan"))
    switch = model.disable_adapter() if use_base else contextlib.nullcontext()
    with inference_mode(model), switch, phase("reference log-probs", examples) as advance:
        for batch in batches:
            table[batch["index"].cpu()] = logps_of(model, batch).float().cpu().T
            advance(len(batch["index"]))
    return table


def save_reference(run_dir: Path, table: torch.Tensor) -> None:
    """Written once, atomically (a temporary file renamed over)."""
    path = Path(run_dir) / REFERENCE_FILE
    partial = path.with_suffix(".partial")
    save_file({"logps": table.contiguous()}, str(partial), metadata={"examples": str(table.shape[0])})
    os.replace(partial, path)


def load_reference(run_dir: Path, examples: int) -> torch.Tensor | None:
    """The run's table, or None when it has none yet (a run stopped before its first checkpoint computes again)."""
    path = Path(run_dir) / REFERENCE_FILE
    if not path.is_file():
        return None
    table = load_file(str(path))["logps"]
    if table.shape != (examples, 2):
        raise BadInput(f"{path}: reference log-probs of {table.shape[0]} examples, the data has {examples}")
    return table
