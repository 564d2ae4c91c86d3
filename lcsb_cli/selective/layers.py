"""Per-step routing of decoder layers: below the active block, the active block, above it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recomputed

from .choices import UPPER_PATHS


class Role(enum.Enum):
    # no autograd: nothing here trains and no gradient needs to reach it
    BELOW = "below"
    # full autograd (recomputed in backward with checkpointing)
    ACTIVE = "active"
    # above the active block, within its exact window: autograd (recomputed with checkpointing), LoRA frozen
    # (trained on the suffix path)
    EXACT = "exact"
    # above, beyond the window: straight-through residual, no graph
    IDENTITY = "identity"


class _StraightThrough(torch.autograd.Function):
    """Forward gives the layer's real output; backward hands the gradient to the layer's input unchanged.

    This is `h + (layer(h) - h).detach()` without the rounding of the add and subtract, and without a graph
    through the layer.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SelectiveLayers:
    """Patches the forward of each layer in `layers` so that `activate(b)` decides how it runs.

    Layers keep their module identity (state-dict keys, PEFT adapters and hooks are untouched): only the
    instance's `forward` is wrapped, as accelerate's hooks do. A layer's trainable parameters are the ones that
    required grad at install time. Below the active block and on the identity path layers run under no_grad, so
    only the active block can collect gradients. The `exact_above` layers just above the active block (all of them
    with `upper_path="exact"`) backpropagate exactly, and `activate` freezes their LoRA; beyond them the gradient
    crosses on the identity path. exact_above=0 is the paper's surrogate. `upper_path="suffix"` is the exact path
    with the LoRA of every layer above the active block trained too: its backward passes through them anyway.
    `checkpoint` recomputes in backward every layer backward runs through (the active block and the exact window),
    so that no layer keeps its activations: the memory of checkpointed full backprop, with a shorter backward.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        blocks: Sequence[range],
        upper_path: str = "identity",
        checkpoint: bool = False,
        exact_above: int = 0,
    ):
        if upper_path not in UPPER_PATHS:
            raise ValueError(f"unknown upper_path {upper_path!r}; choose one of {', '.join(UPPER_PATHS)}")
        self.layers, self.blocks = list(layers), list(blocks)
        self.checkpoint = checkpoint
        self.exact_above = exact_above if upper_path == "identity" else len(self.layers)
        self.trains_upper = upper_path == "suffix"
        self.trainable = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        self.roles = [Role.ACTIVE] * len(self.layers)
        self._originals = [layer.forward for layer in self.layers]
        for index, layer in enumerate(self.layers):
            layer.forward = self._routed_forward(index, layer.forward)

    def block_parameters(self, block: int) -> list[nn.Parameter]:
        return [p for i in self.blocks[block] for p in self.trainable[i]]

    def activate(self, block: int | None) -> None:
        """Make `block` the one that trains; None makes every layer active (full backprop)."""
        active = range(len(self.layers)) if block is None else self.blocks[block]
        for index in range(len(self.layers)):
            self.roles[index] = role = self._role(index, active)
            if self.exact_above:
                trains = role is Role.ACTIVE or (self.trains_upper and role is Role.EXACT)
                for p in self.trainable[index]:
                    p.requires_grad_(trains)

    def _role(self, index: int, active: range) -> Role:
        if index in active:
            return Role.ACTIVE
        if index < active.start:
            return Role.BELOW
        return Role.EXACT if index < active.stop + self.exact_above else Role.IDENTITY

    def remove(self) -> None:
        """Restore the layers' own forward and trainability."""
        for layer, forward, params in zip(self.layers, self._originals, self.trainable):
            layer.forward = forward
            for p in params:
                p.requires_grad_(True)

    def _routed_forward(self, index: int, forward: Callable) -> Callable:
        def routed(*args, **kwargs):
            role = self.roles[index]
            if role is Role.BELOW:
                with torch.no_grad():
                    return forward(*args, **kwargs)
            if role in (Role.ACTIVE, Role.EXACT):
                if self.checkpoint and torch.is_grad_enabled():
                    return recomputed(forward, *args, use_reentrant=False, **kwargs)
                return forward(*args, **kwargs)
            return _straight_through(args[0] if args else kwargs["hidden_states"], forward, args, kwargs)

        return routed


def _straight_through(hidden: torch.Tensor, forward: Callable, args: tuple, kwargs: dict):
    with torch.no_grad():
        out = forward(*args, **kwargs)
    # transformers < 5 returns (hidden_states, ...)
    if isinstance(out, tuple):
        return (_StraightThrough.apply(hidden, out[0]), *out[1:])
    return _StraightThrough.apply(hidden, out)
