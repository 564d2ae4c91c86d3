"""Training methods behind one small interface, all driven by the same engine loop.

A method says which block trains this step (`begin_step`), sees the step's gradient norm (`after_backward`),
may touch the optimizer step (`before_optimizer_step`), and keeps its own resumable state. MeZO, which has
no backward pass, supplies the whole update through `zeroth_order_step`.

Each method also names the recipes that run it: its label in `lcsb bench --compare` (`lcsb:K`,
`full-backprop+ckpt`, ...), so this is the one file that knows method names and their variants.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import BadInput
from ..recipe import get_key, replace_key
from ..recipe.schema import Recipe
from .base import Method, Plan
from .baselines import Freeze, FullBackprop, Lisa, Mezo
from .lcsb import Lcsb

__all__ = ["Freeze", "FullBackprop", "Lcsb", "Lisa", "Method", "Mezo", "Plan"]


METHODS: dict[str, type[Method]] = {m.name: m for m in (Lcsb, FullBackprop, Freeze, Lisa, Mezo)}
# every label `lcsb bench --compare` accepts for the engine's methods
LABEL_FORMS = tuple(form for method in METHODS.values() for form in method.label_forms())


def label_of(recipe: Recipe) -> str:
    """The label of the method `recipe` runs, as it runs it (`lcsb:4:exact`, `full-backprop+ckpt`, `mezo`)."""
    return METHODS[recipe.method].label(recipe)


def recipe_for_label(label: str, recipe: Recipe) -> Recipe | None:
    """`recipe` running the method `label` names (its other keys kept), or None when no method has that label."""
    keys = next((keys for method in METHODS.values() if (keys := method.label_keys(label)) is not None), None)
    if keys is None:
        return None
    for key, value in keys.items():
        recipe = replace_key(recipe, key, value)
    return recipe


def blocks_of(label: str) -> int | None:
    """K of an lcsb label (`lcsb:K`, `lcsb:K:PATH`), or None for any other label (a variant with @KEY=VALUE too)."""
    keys = Lcsb.label_keys(label)
    return None if keys is None else keys["lcsb.blocks"]


def check_layer_counts(recipe: Recipe, num_layers: int) -> None:
    """The ranges that depend on the model (the recipe checks the rest): K and the layer counts of freeze and lisa."""
    key = METHODS[recipe.method].layer_key
    if key and get_key(recipe, key) > num_layers:
        raise BadInput(f"{key}: {get_key(recipe, key)} is more than the model's {num_layers} decoder layers")


def make_optimizer(kind: str, params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """train.optimizer: torch's AdamW, or bitsandbytes' AdamW8bit (the same update with both moments stored
    block-wise in 8 bits: 2 bytes a parameter instead of 8; tensors under 4096 values keep 32-bit moments).
    `params`: parameters, or torch's parameter-group dicts."""
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build_method(
    recipe: Recipe, model: nn.Module, layers: nn.ModuleList, params: list[nn.Parameter]
) -> tuple[Method, torch.optim.Optimizer]:
    """The recipe's method and its optimizer: one over all LoRA `params`, built before any method freezes a layer,
    at the method's learning rate (mezo.lr for MeZO, train.lr for the gradient methods) times each parameter
    group's factor; a group's `lr_scale` entry keeps the factor for the logs."""
    method = METHODS[recipe.method]
    lr = method.learning_rate(recipe)
    groups = method.param_groups(recipe, layers, params)
    if len(groups) > 1:
        params = [{"params": ps, "lr": lr * scale, "lr_scale": scale} for ps, scale in groups]
    optimizer = make_optimizer(recipe.train.optimizer, params, lr, recipe.train.weight_decay)
    return method.build(recipe, model, layers, params, optimizer), optimizer
