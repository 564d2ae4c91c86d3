"""Held-out preference data (`lcsb eval` on a dpo, orpo or kto run): how the trained adapter ranks what the user
chose, against the base (the adapter off) on the same items.

- preference: `accuracy`, the share of pairs whose implicit reward beta * (log pi - log pi_base) ranks chosen above
  rejected (TRL's rewards/accuracies), and `margin`, the mean reward margin; `likelihood_accuracy` ranks by the
  model's own mean per-token log-prob, for the adapter and for the base (`base_likelihood_accuracy`, what the base
  already prefers: near 0.5 means the base holds no such preference). The base's implicit reward is 0 for every
  response, so its `base_accuracy` is its likelihood accuracy.
- feedback: `accuracy`, the share of examples whose implicit reward has the label's sign (> 0 for true), and the
  mean reward of desirable minus undesirable ones; the base's reward is 0, so its `base_accuracy` under the same rule
  is the share of undesirable examples.
"""

from __future__ import annotations

import torch

from ..data import format_of
from ..objectives import PreferenceObjective
from ..objectives.reference import compute_reference
from ..recipe import Recipe


def preference_metrics(model, items: list[dict], pad_id: int, recipe: Recipe, phase) -> dict:
    objective = PreferenceObjective("kto" if recipe.data.format == "feedback" else "dpo", recipe.preference)
    collate, size, device = format_of(recipe).collate(recipe), recipe.eval.batch_size, model.device

    def batches():
        for i in range(0, len(items), size):
            yield {k: v.to(device) for k, v in collate(items[i : i + size], pad_id).items()}

    adapter = compute_reference(model, objective.logps, batches(), len(items), False, phase)
    has_adapter = hasattr(model, "disable_adapter")
    base = compute_reference(model, objective.logps, batches(), len(items), True, phase) if has_adapter else adapter
    reward = recipe.preference.beta * (adapter - base)
    if recipe.data.format == "feedback":
        return feedback_metrics(reward[:, 0], torch.tensor([bool(row["label"]) for row in items]))
    tokens = torch.tensor([[len(row["chosen_ids"]), len(row["rejected_ids"])] for row in items], dtype=torch.float32)
    return pair_metrics(reward, adapter / tokens, base / tokens)


def pair_metrics(reward: torch.Tensor, adapter_mean: torch.Tensor, base_mean: torch.Tensor) -> dict:
    """reward, adapter_mean and base_mean are [pairs, 2] (chosen, rejected)."""

    def ranks(values: torch.Tensor) -> float:
        return float((values[:, 0] > values[:, 1]).float().mean())

    base = ranks(base_mean)
    return {
        "n": reward.shape[0],
        "accuracy": ranks(reward),
        "margin": float((reward[:, 0] - reward[:, 1]).mean()),
        "likelihood_accuracy": ranks(adapter_mean),
        "base_accuracy": base,
        "base_likelihood_accuracy": base,
    }


def feedback_metrics(reward: torch.Tensor, desirable: torch.Tensor) -> dict:
    return {
        "n": reward.shape[0],
        "accuracy": float(((reward > 0) == desirable).float().mean()),
        "margin": float(reward[desirable].mean() - reward[~desirable].mean()),
        "base_accuracy": float((~desirable).float().mean()),
    }
