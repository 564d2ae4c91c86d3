"""The methods LCSB is measured against, in the same engine: full backprop (with or without checkpointing), the
paper's Freeze, LISA and MeZO."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Method, Plan, layer_params, span


class FullBackprop(Method):
    """Every layer trains every step; `activation_checkpointing` recomputes each layer in backward (MeBP)."""

    name = "full-backprop"
    checkpointed = f"{name}+ckpt"

    def __init__(self, model: nn.Module, checkpointing: bool):
        if checkpointing:
            self.name = self.checkpointed
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def label(cls, recipe):
        return cls.checkpointed if recipe.activation_checkpointing else cls.name

    @classmethod
    def label_forms(cls):
        return cls.name, cls.checkpointed

    @classmethod
    def label_keys(cls, label):
        if label not in cls.label_forms():
            return None
        return {"method": cls.name, "activation_checkpointing": label == cls.checkpointed}

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(model, recipe.activation_checkpointing)


class Freeze(Method):
    """The paper's Freeze baseline: only the top `freeze.layers` layers' LoRA trains; backward stops there."""

    name, section, layer_key = "freeze", "freeze", "freeze.layers"

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(layers, recipe.freeze.layers)

    @classmethod
    def plan(cls, recipe, layers):
        top = range(layers - recipe.freeze.layers, layers)
        return Plan(1, *span(layers, top.start, layers, top))

    def __init__(self, layers: nn.ModuleList, top: int):
        for params in layer_params(layers)[: len(layers) - top]:
            for p in params:
                p.requires_grad_(False)


class Lisa(Method):
    """LISA: `lisa.layers` layers, drawn at random every `lisa.interval` steps, train; the others' LoRA is frozen
    (gradients still flow through layers above the lowest trained one). The draw and its RNG are checkpointed."""

    name, section, layer_key = "lisa", "lisa", "lisa.layers"

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(layers, recipe.lisa.layers, recipe.lisa.interval, recipe.train.seed)

    @classmethod
    def plan(cls, recipe, layers):
        """`drawn` of `layers` uniformly: the lowest drawn is layer i with C(N-1-i, c-1) / C(N, c)."""
        drawn, draws = recipe.lisa.layers, math.comb(layers, recipe.lisa.layers)
        lowest = tuple(math.comb(layers - 1 - i, drawn - 1) / draws for i in range(layers))
        through = tuple(1 - math.comb(layers - 1 - i, drawn) / draws for i in range(layers))
        return Plan(1, through, lowest, (drawn / layers,) * layers)

    def __init__(self, layers: nn.ModuleList, count: int, interval: int, seed: int):
        self.params = layer_params(layers)
        self.count, self.interval = count, interval
        self.generator = torch.Generator().manual_seed(seed)
        self.step, self.chosen = 0, []

    def begin_step(self) -> None:
        if self.step % self.interval == 0 or not self.chosen:
            self.chosen = sorted(torch.randperm(len(self.params), generator=self.generator)[: self.count].tolist())
            self._freeze_others()
        self.step += 1
        return None

    def _freeze_others(self) -> None:
        for index, params in enumerate(self.params):
            for p in params:
                p.requires_grad_(index in self.chosen)

    def state_dict(self) -> dict:
        return {"step": self.step, "chosen": list(self.chosen), "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.chosen = int(state["step"]), [int(i) for i in state["chosen"]]
        self.generator.set_state(state["rng"])
        self._freeze_others()


class Mezo(Method):
    """MeZO (Malladi et al. 2023): forward-only SPSA on the LoRA parameters.

    With z ~ N(0, I) regenerated from a per-step seed (never stored):
        g = (L(theta + eps z) - L(theta - eps z)) / (2 eps);   theta <- theta - lr * g * z
    Two forwards per step, no backward, no optimizer state; the step's seeds come from a checkpointed RNG.
    """

    name, section = "mezo", "mezo"
    zeroth_order, data_parallel = True, False

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(params, recipe.mezo.eps, recipe.train.seed)

    @classmethod
    def learning_rate(cls, recipe):
        return recipe.mezo.lr

    @classmethod
    def plan(cls, recipe, layers):
        """Two forwards, no backward."""
        return Plan(2, *([(0.0,) * layers] * 3))

    def __init__(self, params: list[nn.Parameter], eps: float, seed: int):
        self.params, self.eps = params, eps
        self.generator = torch.Generator().manual_seed(seed)

    def zeroth_order_step(self, loss_at, lr: float) -> tuple[float, float]:
        """(loss at theta, |projected gradient|); `loss_at()` returns the step's loss at the current weights."""
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        with torch.no_grad():
            self._perturb(seed, self.eps)
            plus = loss_at()
            self._perturb(seed, -2 * self.eps)
            minus = loss_at()
            self._perturb(seed, self.eps)
            projected = (plus - minus) / (2 * self.eps)
            self._perturb(seed, -lr * projected)
        return (plus + minus) / 2, abs(projected)

    def _perturb(self, seed: int, scale: float) -> None:
        generator = torch.Generator(device=self.params[0].device).manual_seed(seed)
        for p in self.params:
            p.add_(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype), alpha=scale)

    def state_dict(self) -> dict:
        return {"rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["rng"])
