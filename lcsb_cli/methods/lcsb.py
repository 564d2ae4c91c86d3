"""Layer-cyclic selective backprop as an engine method: the recipe's lcsb section onto the core (selective/)."""

from __future__ import annotations

import re
import statistics

import torch
from torch import nn

from ..recipe_schema import LcsbConfig
from ..selective import (
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
        """One group per block at its `lcsb.lr_scale` factor (one group when there is no scaling)."""
        cfg = recipe.lcsb
        if cfg.lr_scale == "none":
            return super().param_groups(recipe, layers, params)
        blocks = partition(len(layers), cfg.blocks)
        per_layer = layer_params(layers)
        scales = rate_scales(gradient_shares(cfg.blocks, cfg.upper_path), cfg.lr_scale)
        groups = [([p for i in block for p in per_layer[i]], scale) for block, scale in zip(blocks, scales)]
        in_layers = {p for group, _ in groups for p in group}
        rest = [p for p in params if p not in in_layers]
        return groups + ([(rest, 1.0)] if rest else [])

    @classmethod
    def plan(cls, recipe, layers):
        """Averaged over the K blocks (identity: the active block only; exact / exactW: the block and the layers
        above it that backprop exactly; suffix: those layers all train)."""
        cfg = recipe.lcsb
        window = cfg.exact_above if cfg.upper_path == "identity" else layers
        trained_to = (lambda block: layers) if cfg.upper_path == "suffix" else (lambda block: block.stop)
        spans = [
            span(layers, block.start, block.stop + window, range(block.start, trained_to(block)))
            for block in partition(layers, cfg.blocks)
        ]
        return Plan(1, *(tuple(map(statistics.fmean, zip(*parts))) for parts in zip(*spans)))

    @classmethod
    def label(cls, recipe):
        cfg = recipe.lcsb
        if cfg.upper_path == "identity":
            window = f":exact{cfg.exact_above}" if cfg.exact_above else ""
        else:
            window = f":{cfg.upper_path}"
        return f"{cls.name}:{cfg.blocks}{window}"

    @classmethod
    def label_forms(cls):
        return tuple(f"{cls.name}:K{window}" for window in ("", ":exact", ":exactW", ":suffix"))

    @classmethod
    def label_keys(cls, label):
        """`lcsb:K` (the recipe's own upper path), `lcsb:K:exact` (upper_path exact), `lcsb:K:exactW` (the
        identity path with lcsb.exact_above W) or `lcsb:K:suffix`; K >= 1."""
        match = re.fullmatch(rf"{cls.name}:(\d+)(?::(suffix|exact)(\d*))?", label)
        if match is None or int(match[1]) < 1 or (match[2] == "suffix" and match[3]):
            return None
        keys = {"method": cls.name, "lcsb.blocks": int(match[1])}
        if match[2] is None:
            return keys
        if not match[3]:
            return {**keys, "lcsb.upper_path": match[2]}
        return {**keys, "lcsb.upper_path": "identity", "lcsb.exact_above": int(match[3])}

    def __init__(
        self, layers: nn.ModuleList, optimizer: torch.optim.Optimizer, cfg: LcsbConfig, checkpointing: bool, seed: int
    ):
        self.blocks, self.optimizer = cfg.blocks, optimizer
        self.selective = SelectiveLayers(
            layers, partition(len(layers), cfg.blocks), cfg.upper_path, checkpointing, cfg.exact_above
        )
        self.schedule = BlockSchedule(cfg.blocks, cfg.schedule, seed=seed, switch_every=cfg.switch_every)
        self.resets_on_return = cfg.on_return == "reset"
        block_params = [self.selective.block_parameters(b) for b in range(cfg.blocks)]
        self.idle = IdleMomentum(optimizer, block_params) if cfg.idle_update == "momentum" else None

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
