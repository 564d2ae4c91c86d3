"""`lcsb train`'s one entry point, for a run of one adapter or of one per user alike."""

from __future__ import annotations

from pathlib import Path

from ..recipe import Recipe, with_autocast_chosen
from .engine import train_adapter
from .per_user import train_per_user


def train(recipe: Recipe, run_dir: Path, display, resume: bool = False, force: bool = False) -> dict:
    """Resolve `train.autocast: auto` (the one place it is resolved: config.yaml records the choice, and every
    part of the run reads it), then train one adapter, or one per user when `data.user` is all."""
    recipe, _ = with_autocast_chosen(recipe)
    run = train_per_user if recipe.data.user == "all" else train_adapter
    return run(recipe, Path(run_dir), display, resume=resume, force=force)
