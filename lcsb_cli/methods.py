"""Training methods behind one small interface, all driven by the same engine loop."""

from __future__ import annotations

import torch
from torch import nn

from .recipe import Recipe
from .selective import BlockSchedule, IdleMomentum, SelectiveLayers, partition


class FullBackprop:
    """Every layer trains every step; `activation_checkpointing` recomputes each layer in backward."""

    name = "full-backprop"
    blocks = 1

    def __init__(self, model: nn.Module, checkpointing: bool):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    def begin_step(self) -> int | None:
        return None

    def before_optimizer_step(self, active: int | None) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Lcsb:
    """Layer-cyclic selective backprop: one block of layers trains per step (DESIGN.md, LCSB semantics)."""

    name = "lcsb"

    def __init__(self, layers: nn.ModuleList, optimizer: torch.optim.Optimizer, recipe: Recipe):
        cfg = recipe.lcsb
        self.blocks = cfg.blocks
        self.selective = SelectiveLayers(
            layers, partition(len(layers), cfg.blocks), cfg.upper_path, recipe.activation_checkpointing
        )
        self.schedule = BlockSchedule(cfg.blocks, cfg.schedule, seed=recipe.train.seed)
        block_params = [self.selective.block_parameters(b) for b in range(cfg.blocks)]
        self.idle = IdleMomentum(optimizer, block_params) if cfg.idle_update == "momentum" else None

    def begin_step(self) -> int:
        block = self.schedule.next_block()
        self.selective.activate(block)
        return block

    def before_optimizer_step(self, active: int | None) -> None:
        if self.idle is not None:
            self.idle.before_step(active)

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])


def build_method(recipe: Recipe, model: nn.Module, layers: nn.ModuleList, optimizer: torch.optim.Optimizer):
    if recipe.method == "full-backprop":
        return FullBackprop(model, recipe.activation_checkpointing)
    return Lcsb(layers, optimizer, recipe)
