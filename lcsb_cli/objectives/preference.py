"""DPO, ORPO and KTO as the trainer sees them: a summed loss per micro-batch (the trainer divides by `count`, the
examples of the step), TRL-named metrics per step, and the reference table (objectives/reference.py)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from ..recipe.schema import PreferenceConfig
from . import reference
from .logps import cross_entropy_rows, response_tokens, sequence_logps
from .losses import dpo_losses, kto_kl, kto_losses, orpo_loss


class PreferenceObjective:
    def __init__(self, name: str, config: PreferenceConfig):
        self.name, self.config = name, config
        self.needs_reference = name != "orpo"
        # [examples, 2], filled before step 1 (see `prepare`)
        self.table: torch.Tensor | None = None
        self.computed = False
        self._metrics: dict[str, list[float]] = defaultdict(list)

    def logps(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """[2, B]: chosen and rejected responses, or (kto) the completions and, without gradient, the KL pairs."""
        if self.name != "kto":
            return sequence_logps(model, batch).view(2, -1)
        with torch.no_grad():
            kl = sequence_logps(model, batch, "kl_")
        return torch.stack((sequence_logps(model, batch), kl))

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The micro-batch's loss summed over its examples (TRL's mean times the examples)."""
        logps = self.logps(model, batch)
        if self.name == "orpo":
            tokens = response_tokens(batch).view(2, -1)
            loss, metrics = orpo_loss(logps / tokens, cross_entropy_rows(logps[0], tokens[0]), self.config.orpo_lambda)
            summed = loss * logps.shape[1]
        else:
            ref = self.table[batch["index"].cpu()].T.to(logps.device)
            losses, metrics = self._referenced_losses(logps, ref, batch)
            summed = losses.sum()
        for name, value in metrics.items():
            self._metrics[name].append(value)
        return summed

    def _referenced_losses(self, logps: torch.Tensor, ref: torch.Tensor, batch: dict):
        cfg = self.config
        if self.name == "dpo":
            return dpo_losses(logps, ref, cfg.beta, cfg.label_smoothing)
        kl = kto_kl(logps[1], ref[1])
        weights = (cfg.desirable_weight, cfg.undesirable_weight)
        return kto_losses(logps[0], ref[0], batch["label"], kl, cfg.beta, weights)

    @staticmethod
    def count(batch: dict) -> int:
        return int(batch["index"].numel())

    def step_metrics(self) -> dict:
        """The step's metrics, each the mean over its micro-batches."""
        metrics = {name: sum(values) / len(values) for name, values in self._metrics.items()}
        self._metrics.clear()
        return metrics

    def prepare(self, model, batches, examples: int, run_dir: Path, warm: bool, phase=None) -> None:
        """The reference table: the run's own (--resume), else computed now, from the base with the adapter off, or
        from the starting adapter of a warm start (lora.init)."""
        if not self.needs_reference:
            return
        self.table = reference.load_reference(run_dir, examples)
        if self.table is None:
            self.table = reference.compute_reference(
                model, self.logps, batches, examples, not warm, phase or reference.no_progress
            )
            self.computed = True

    def save(self, run_dir: Path) -> None:
        if self.computed:
            reference.save_reference(run_dir, self.table)
