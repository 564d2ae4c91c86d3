"""Training state on disk: checkpoints with everything exact resume needs, and the final adapter."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import get_peft_model_state_dict

from ..atomic import write_dir
from ..errors import BadInput
from ..model import adapter as adapters
from ..rundir import RunDir
from ..rundir.checkpoint import (
    ADAPTER_FILE,
    CorruptCheckpoint,
    checkpoint_dirs,
    load_checkpoint,
    save_checkpoint,
    step_of,
)

KEEP_CHECKPOINTS = 3


def save_state(run_dir: Path, step: int, trainer, wall_time_s: float, best: dict | None = None) -> None:
    """A checkpoint of everything exact resume needs; `best`: the run's BestWatch state (keep_best, early stopping)."""
    state = {
        "step": step,
        "wall_time_s": wall_time_s,
        "optimizer": trainer.optimizer.state_dict(),
        "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "method": trainer.method.state_dict(),
        "trainer": trainer.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
        "best": best,
    }
    adapter = get_peft_model_state_dict(trainer.model, save_embedding_layers=False)
    save_checkpoint(RunDir(run_dir).checkpoints, step, adapter, state, keep=KEEP_CHECKPOINTS)


def resume_state(run_dir: Path, trainer) -> tuple[int, float, list[dict], dict | None]:
    """Restore the newest intact checkpoint; a corrupt one (checksum mismatch) is skipped and reported. Returns its
    step, training seconds, the notes on skipped checkpoints and the BestWatch state it holds (None: none kept)."""
    notes = []
    for path in checkpoint_dirs(RunDir(run_dir).checkpoints):
        try:
            adapter, state = load_checkpoint(path)
        except CorruptCheckpoint as exc:
            notes.append({"step": step_of(path), "event": "checkpoint_corrupt", "reason": str(exc)})
            continue
        restore(adapter, state, trainer, path / ADAPTER_FILE)
        step = int(state["step"])
        for note in notes:
            note["resumed_from"] = step
        return step, float(state["wall_time_s"]), notes, state.get("best")
    raise BadInput(f"{run_dir}: no intact checkpoint to resume from ({notes[-1]['reason'] if notes else 'none'})")


def restore(adapter: dict, state: dict, trainer, source: Path) -> None:
    adapters.apply(trainer.model, adapter, source)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
    trainer.method.load_state_dict(state["method"])
    trainer.load_state_dict(state["trainer"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def save_adapter(model, target: Path) -> None:
    """PEFT format (adapter_config.json + adapter_model.safetensors), replaced atomically."""
    # LoRA never
    write_dir(target, lambda tmp: model.save_pretrained(tmp, save_embedding_layers=False), replace=True)
    # targets embeddings, so peft need not look the base up (on the Hub) to decide whether to save them
