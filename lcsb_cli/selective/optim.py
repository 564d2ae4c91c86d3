"""The idle-block update rule around one torch AdamW built over every LoRA parameter."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class IdleMomentum:
    """Lets idle blocks keep moving on their stored AdamW moments (the paper's momentum reuse).

    `before_step(active)` gives each parameter of an idle block that already has AdamW state a zero gradient,
    so the optimizer's own step applies, for such a parameter p with moments (m, v) and step count s:

        s <- s + 1
        m <- beta1 * m                       # first moment decays; no new gradient arrives
        v <- beta2 * v
        p <- p * (1 - lr * weight_decay) - lr * (m / (1 - beta1**s)) / (sqrt(v / (1 - beta2**s)) + eps)

    i.e. exactly torch.optim.AdamW's update for a zero gradient (decoupled weight decay, bias correction
    with the parameter's own step count). Parameters never active yet have no moments and are not touched;
    with `idle_update: none` idle blocks keep grad None, which AdamW skips entirely.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, block_params: Sequence[Sequence[nn.Parameter]]):
        self.optimizer = optimizer
        self.block_params = [list(params) for params in block_params]
        self.zeros = _shared_zeros(p for params in self.block_params for p in params)

    def before_step(self, active: int) -> None:
        state = self.optimizer.state
        for block, params in enumerate(self.block_params):
            if block == active:
                continue
            for p in params:
                if p.grad is None and p in state:
                    p.grad = self.zeros[(p.dtype, p.device)][: p.numel()].view_as(p)


def _shared_zeros(params) -> dict[tuple, torch.Tensor]:
    """One zero buffer per (dtype, device), as long as the largest parameter: every idle gradient is a view of it.
    AdamW only reads gradients and the engine sets them to None after each step, so sharing is safe."""
    sizes: dict[tuple, int] = {}
    for p in params:
        key = (p.dtype, p.device)
        sizes[key] = max(sizes.get(key, 0), p.numel())
    return {(dtype, device): torch.zeros(n, dtype=dtype, device=device) for (dtype, device), n in sizes.items()}


def gradient_shares(num_blocks: int, upper_path: str) -> list[float]:
    """The share of steps on which each block gets a gradient when the schedule visits every block equally: 1/K,
    or (b+1)/K on the suffix path, where block b also trains whenever a block below it is the active one."""
    if upper_path == "suffix":
        return [(block + 1) / num_blocks for block in range(num_blocks)]
    return [1 / num_blocks] * num_blocks


def rate_scales(shares: Sequence[float], lr_scale: str) -> list[float]:
    """Per-block learning-rate factors for `lcsb.experimental.lr_scale`.

    For a steady gradient g that arrives on a share f of the steps, AdamW's moments average m ~ f g and
    v ~ f g^2, so with idle momentum the parameter moves about sqrt(f) as far per step as under full backprop
    (`sqrt_k` gives back 1/sqrt(f)); with `idle_update: none` it moves only on its own steps, f as far (`k` gives
    back 1/f). `none` keeps the recipe's rate.
    """
    if lr_scale == "none":
        return [1.0] * len(shares)
    power = 0.5 if lr_scale == "sqrt_k" else 1.0
    return [(1 / share) ** power for share in shares]


def forget_moments(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """`lcsb.experimental.on_return: reset`: a block that comes back starts AdamW afresh (BAdam's choice), its moments
    and step count gone, so its first step is bias-corrected from zero."""
    for p in params:
        optimizer.state.pop(p, None)
