"""Layer-cyclic selective backprop as an engine method: the recipe's lcsb section onto the core (selective/)."""

from __future__ import annotations

import dataclasses
import re
import statistics

import torch
from torch import nn

from ..recipe.schema import LcsbConfig, LcsbExperimental
from ..selective import (
    UPPER_PATHS,
    BlockSchedule,
    IdleMomentum,
    SelectiveLayers,
    forget_moments,
    gradient_shares,
    partition,
    rate_scales,
)
from .base import Method, Plan, layer_params, span


class Lcsb(Method):
    """Layer-cyclic selective backprop: one block of layers trains per step (docs/ARCHITECTURE.md, the core)."""

    name, section, layer_key = "lcsb", "lcsb", "lcsb.blocks"

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(layers, optimizer, recipe.lcsb, recipe.activation_checkpointing, recipe.train.seed)

    @classmethod
    def param_groups(cls, recipe, layers, params):
        """One group per block at its `lcsb.experimental.lr_scale` factor (one group when there is no scaling)."""
        cfg = recipe.lcsb
        if cfg.experimental.lr_scale == "none":
            return super().param_groups(recipe, layers, params)
        blocks = partition(len(layers), cfg.blocks)
        per_layer = layer_params(layers)
        scales = rate_scales(gradient_shares(cfg.blocks, cfg.upper_path), cfg.experimental.lr_scale)
        groups = [([p for i in block for p in per_layer[i]], scale) for block, scale in zip(blocks, scales)]
        in_layers = {p for group, _ in groups for p in group}
        rest = [p for p in params if p not in in_layers]
        return groups + ([(rest, 1.0)] if rest else [])

    @classmethod
    def plan(cls, recipe, layers):
        """Averaged over the K blocks (identity: the active block only; exact / exactW: the block and the layers
        above it that backprop exactly; suffix: those layers all train)."""
        cfg = recipe.lcsb
        window = cfg.experimental.exact_above if cfg.upper_path == "identity" else layers
        trained_to = (lambda block: layers) if cfg.upper_path == "suffix" else (lambda block: block.stop)
        spans = [
            span(layers, block.start, block.stop + window, range(block.start, trained_to(block)))
            for block in partition(layers, cfg.blocks)
        ]
        return Plan(1, *(tuple(map(statistics.fmean, zip(*parts))) for parts in zip(*spans)))

    @classmethod
    def label(cls, recipe):
        """`lcsb:K:PATH`, then `@lcsb.experimental.KEY=VALUE` for each experimental dial set off its default."""
        cfg = recipe.lcsb
        dials = [
            f"lcsb.experimental.{f.name}={getattr(cfg.experimental, f.name)}"
            for f in dataclasses.fields(LcsbExperimental)
            if getattr(cfg.experimental, f.name) != f.default
        ]
        return f"{cls.name}:{cfg.blocks}:{cfg.upper_path}" + (f"@{','.join(dials)}" if dials else "")

    @classmethod
    def label_forms(cls):
        return tuple(f"{cls.name}:K{path}" for path in ("", ":suffix", ":exact", ":identity"))

    @classmethod
    def label_keys(cls, label):
        """`lcsb:K` (the recipe's own upper path) or `lcsb:K:PATH` (suffix, exact or identity); K >= 1."""
        match = re.fullmatch(rf"{cls.name}:(\d+)(?::({'|'.join(UPPER_PATHS)}))?", label)
        if match is None or int(match[1]) < 1:
            return None
        keys = {"method": cls.name, "lcsb.blocks": int(match[1])}
        return keys if match[2] is None else {**keys, "lcsb.upper_path": match[2]}

    def __init__(
        self, layers: nn.ModuleList, optimizer: torch.optim.Optimizer, cfg: LcsbConfig, checkpointing: bool, seed: int
    ):
        self.blocks, self.optimizer, dials = cfg.blocks, optimizer, cfg.experimental
        self.selective = SelectiveLayers(
            layers, partition(len(layers), cfg.blocks), cfg.upper_path, checkpointing, dials.exact_above
        )
        self.schedule = BlockSchedule(cfg.blocks, dials.schedule, seed=seed, switch_every=dials.switch_every)
        self.resets_on_return = dials.on_return == "reset"
        block_params = [self.selective.block_parameters(b) for b in range(cfg.blocks)]
        self.idle = IdleMomentum(optimizer, block_params) if dials.idle_update == "momentum" else None

    def begin_step(self) -> int:
        previous = self.schedule.current
        block = self.schedule.next_block()
        if self.resets_on_return and block != previous:
            forget_moments(self.optimizer, self.selective.block_parameters(block))
        self.selective.activate(block)
        return block

    def after_backward(self, active: int | None, grad_norm: float) -> None:
        self.schedule.observe(active, grad_norm)

    def before_optimizer_step(self, active: int | None) -> None:
        if self.idle is not None:
            self.idle.before_step(active)

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])
