"""What every training method is to the engine: the Method interface and the Plan of what its backward touches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..recipe.schema import Recipe


@dataclass(frozen=True)
class Plan:
    """What a method's backward differentiates, per decoder layer, as the expectation over its blocks or draws:
    `through`, the chance backward runs through the layer; `lowest`, that it is the lowest such layer (its input
    has no graph, so its q/k/v input gradients are not needed); `trained`, that its LoRA gets weight gradients.
    `forwards`: forward passes a step. The bench's roofline counts a step's FLOPs from it."""

    forwards: int
    through: tuple[float, ...]
    lowest: tuple[float, ...]
    trained: tuple[float, ...]


def span(layers: int, start: int, stop: int, trained: range) -> tuple[tuple[float, ...], ...]:
    through = tuple(float(start <= i < stop) for i in range(layers))
    return through, tuple(float(i == start) for i in range(layers)), tuple(float(i in trained) for i in range(layers))


class Method:
    """A registry entry (METHODS) and the object the engine drives. Class attributes: `section`, the recipe
    section it reads; `layer_key`, a count the model's layers bound; `zeroth_order`; `data_parallel`."""

    name = "method"
    section: str | None = None
    layer_key: str | None = None
    blocks = 1
    zeroth_order = False
    data_parallel = True

    @classmethod
    def build(
        cls,
        recipe: Recipe,
        model: nn.Module,
        layers: nn.ModuleList,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
    ) -> Method:
        raise NotImplementedError

    @classmethod
    def learning_rate(cls, recipe: Recipe) -> float:
        return recipe.train.lr

    @classmethod
    def param_groups(
        cls, recipe: Recipe, layers: nn.ModuleList, params: list[nn.Parameter]
    ) -> list[tuple[list[nn.Parameter], float]]:
        """The optimizer's parameter groups as (parameters, learning-rate factor): one group at the recipe's rate."""
        return [(params, 1.0)]

    @classmethod
    def plan(cls, recipe: Recipe, layers: int) -> Plan:
        """Every layer, every step."""
        return Plan(1, *span(layers, 0, layers, range(layers)))

    @classmethod
    def label(cls, recipe: Recipe) -> str:
        """Its name in `lcsb bench --compare` (and bench.json) for `recipe`, which runs it."""
        return cls.name

    @classmethod
    def label_forms(cls) -> tuple[str, ...]:
        """The labels it answers to, as error messages list them (K, W: numbers)."""
        return (cls.name,)

    @classmethod
    def label_keys(cls, label: str) -> dict | None:
        """The recipe keys (dotted key -> value) that make a recipe run `label`; None when it is not this
        method's label."""
        return {"method": cls.name} if label == cls.name else None

    def begin_step(self) -> int | None:
        return None

    def after_backward(self, active: int | None, grad_norm: float) -> None:
        pass

    def before_optimizer_step(self, active: int | None) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def layer_params(layers: nn.ModuleList) -> list[list[nn.Parameter]]:
    return [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
