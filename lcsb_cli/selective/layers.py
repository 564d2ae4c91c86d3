"""Per-step routing of decoder layers: below the active block, the active block, above it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

UPPER_PATHS = ("identity", "exact")


class Role(enum.Enum):
    BELOW = "below"  # no autograd: nothing here trains and no gradient needs to reach it
    ACTIVE = "active"  # full autograd (optionally recomputed in backward)
    ABOVE = "above"  # identity: straight-through residual; exact: autograd with LoRA frozen


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
    only the active block can collect gradients; with `exact`, `activate` also freezes the LoRA of the layers
    above, whose graph the gradient must cross.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        blocks: Sequence[range],
        upper_path: str = "identity",
        checkpoint_active: bool = False,
    ):
        if upper_path not in UPPER_PATHS:
            raise ValueError(f"unknown upper_path {upper_path!r}; choose one of {', '.join(UPPER_PATHS)}")
        self.layers, self.blocks = list(layers), list(blocks)
        self.upper_path, self.checkpoint_active = upper_path, checkpoint_active
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
            if index in active:
                role = Role.ACTIVE
            else:
                role = Role.BELOW if index < active.start else Role.ABOVE
            self.roles[index] = role
            if self.upper_path == "exact":
                for p in self.trainable[index]:
                    p.requires_grad_(role is Role.ACTIVE)

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
            if role is Role.ACTIVE:
                if self.checkpoint_active and torch.is_grad_enabled():
                    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
                return forward(*args, **kwargs)
            if self.upper_path == "exact":
                return forward(*args, **kwargs)
            return _straight_through(args[0] if args else kwargs["hidden_states"], forward, args, kwargs)

        return routed


def _straight_through(hidden: torch.Tensor, forward: Callable, args: tuple, kwargs: dict):
    with torch.no_grad():
        out = forward(*args, **kwargs)
    if isinstance(out, tuple):  # transformers < 5 returns (hidden_states, ...)
        return (_StraightThrough.apply(hidden, out[0]), *out[1:])
    return _StraightThrough.apply(hidden, out)
