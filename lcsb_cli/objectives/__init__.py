"""What the loss is, orthogonal to the method (which layers get gradients): sft, today's summed token cross-entropy
(model/losses.py, the trainer's default), or a preference objective, dpo, orpo or kto (preference.py): its loss
(losses.py) on response log-probs (logps.py), TRL-named metrics, and the reference log-probs kept with the run
(reference.py)."""

from __future__ import annotations

from ..recipe import Recipe
from .preference import PreferenceObjective

__all__ = ["PreferenceObjective", "build_objective"]


def build_objective(recipe: Recipe) -> PreferenceObjective | None:
    """None for sft: the trainer's own loss, count and metrics, unchanged."""
    return None if recipe.objective == "sft" else PreferenceObjective(recipe.objective, recipe.preference)
