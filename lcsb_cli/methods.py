"""Training methods behind one small interface, all driven by the same engine loop.

A method says which block trains this step (`begin_step`), sees the step's gradient norm (`after_backward`),
may touch the optimizer step (`before_optimizer_step`), and keeps its own resumable state. MeZO, which has
no backward pass, supplies the whole update through `zeroth_order_step`.

Each method also names the recipes that run it: its label in `lcsb bench --compare` (`lcsb:K`,
`full-backprop+ckpt`, ...), so this is the one file that knows method names and their variants.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from .errors import BadInput
from .recipe import get_key, replace_key
from .recipe_schema import LcsbConfig, Recipe
from .selective import BlockSchedule, IdleMomentum, SelectiveLayers, partition


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


def _span(layers: int, start: int, stop: int, trained: range) -> tuple[tuple[float, ...], ...]:
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
    def plan(cls, recipe: Recipe, layers: int) -> Plan:
        """Every layer, every step."""
        return Plan(1, *_span(layers, 0, layers, range(layers)))

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


class Lcsb(Method):
    """Layer-cyclic selective backprop: one block of layers trains per step (docs/ARCHITECTURE.md, the core)."""

    name, section, layer_key = "lcsb", "lcsb", "lcsb.blocks"

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(layers, optimizer, recipe.lcsb, recipe.activation_checkpointing, recipe.train.seed)

    @classmethod
    def plan(cls, recipe, layers):
        """Averaged over the K blocks (identity: the active block only; exact / exactW: the block and the layers
        above it that backprop exactly)."""
        window = layers if recipe.lcsb.upper_path == "exact" else recipe.lcsb.exact_above
        spans = [
            _span(layers, block.start, block.stop + window, block) for block in partition(layers, recipe.lcsb.blocks)
        ]
        return Plan(1, *(tuple(map(statistics.fmean, zip(*parts))) for parts in zip(*spans)))

    @classmethod
    def label(cls, recipe):
        cfg = recipe.lcsb
        window = ":exact" if cfg.upper_path == "exact" else f":exact{cfg.exact_above}" if cfg.exact_above else ""
        return f"{cls.name}:{cfg.blocks}{window}"

    @classmethod
    def label_forms(cls):
        return tuple(f"{cls.name}:K{window}" for window in ("", ":exact", ":exactW"))

    @classmethod
    def label_keys(cls, label):
        """`lcsb:K` (the recipe's own upper path), `lcsb:K:exact` (upper_path exact) or `lcsb:K:exactW` (the
        identity path with lcsb.exact_above W); K >= 1."""
        # group 2: None without a window, "" for exact, W for exactW
        match = re.fullmatch(rf"{cls.name}:(\d+)(?::exact(\d*))?", label)
        if match is None or int(match[1]) < 1:
            return None
        keys = {"method": cls.name, "lcsb.blocks": int(match[1])}
        if match[2] is None:
            return keys
        if not match[2]:
            return {**keys, "lcsb.upper_path": "exact"}
        return {**keys, "lcsb.upper_path": "identity", "lcsb.exact_above": int(match[2])}

    def __init__(
        self, layers: nn.ModuleList, optimizer: torch.optim.Optimizer, cfg: LcsbConfig, checkpointing: bool, seed: int
    ):
        self.blocks = cfg.blocks
        self.selective = SelectiveLayers(
            layers, partition(len(layers), cfg.blocks), cfg.upper_path, checkpointing, cfg.exact_above
        )
        self.schedule = BlockSchedule(cfg.blocks, cfg.schedule, seed=seed)
        block_params = [self.selective.block_parameters(b) for b in range(cfg.blocks)]
        self.idle = IdleMomentum(optimizer, block_params) if cfg.idle_update == "momentum" else None

    def begin_step(self) -> int:
        block = self.schedule.next_block()
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


def _layer_params(layers: nn.ModuleList) -> list[list[nn.Parameter]]:
    return [[p for p in layer.parameters() if p.requires_grad] for layer in layers]


class Freeze(Method):
    """The paper's Freeze baseline: only the top `freeze.layers` layers' LoRA trains; backward stops there."""

    name, section, layer_key = "freeze", "freeze", "freeze.layers"

    @classmethod
    def build(cls, recipe, model, layers, params, optimizer):
        return cls(layers, recipe.freeze.layers)

    @classmethod
    def plan(cls, recipe, layers):
        top = range(layers - recipe.freeze.layers, layers)
        return Plan(1, *_span(layers, top.start, layers, top))

    def __init__(self, layers: nn.ModuleList, top: int):
        for params in _layer_params(layers)[: len(layers) - top]:
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
        self.params = _layer_params(layers)
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
    """K of an lcsb label (`lcsb:K`, `lcsb:K:exact[W]`), or None for any other label."""
    keys = Lcsb.label_keys(label)
    return None if keys is None else keys["lcsb.blocks"]


def check_layer_counts(recipe: Recipe, num_layers: int) -> None:
    """The ranges that depend on the model (the recipe checks the rest): K and the layer counts of freeze and lisa."""
    key = METHODS[recipe.method].layer_key
    if key and get_key(recipe, key) > num_layers:
        raise BadInput(f"{key}: {get_key(recipe, key)} is more than the model's {num_layers} decoder layers")


def make_optimizer(kind: str, params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """train.optimizer: torch's AdamW, or bitsandbytes' AdamW8bit (the same update with both moments stored
    block-wise in 8 bits: 2 bytes a parameter instead of 8; tensors under 4096 values keep 32-bit moments)."""
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build_method(
    recipe: Recipe, model: nn.Module, layers: nn.ModuleList, params: list[nn.Parameter]
) -> tuple[Method, torch.optim.Optimizer]:
    """The recipe's method and its optimizer: one over all LoRA `params`, built before any method freezes a layer,
    at the method's learning rate (mezo.lr for MeZO, train.lr for the gradient methods)."""
    method = METHODS[recipe.method]
    optimizer = make_optimizer(recipe.train.optimizer, params, method.learning_rate(recipe), recipe.train.weight_decay)
    return method.build(recipe, model, layers, params, optimizer), optimizer
