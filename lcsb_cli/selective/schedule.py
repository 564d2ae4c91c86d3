"""Which block of decoder layers trains at step t."""

from __future__ import annotations

import torch

from .choices import SCHEDULES

# weight of the previous estimate in a block's gradient-norm average
EMA = 0.7


def partition(num_layers: int, num_blocks: int) -> list[range]:
    """Split layers [0, num_layers) into contiguous blocks whose sizes differ by at most one."""
    if not 1 <= num_blocks <= num_layers:
        raise ValueError(f"blocks must be in [1, {num_layers}], got {num_blocks}")
    base, extra = divmod(num_layers, num_blocks)
    blocks, start = [], 0
    for b in range(num_blocks):
        size = base + (1 if b < extra else 0)
        blocks.append(range(start, start + size))
        start += size
    return blocks


class BlockSchedule:
    """Picks the active block for each step; `random` draws a fresh permutation of the blocks per cycle.

    A block, once picked, stays for `switch_every` steps (BAdam's and HiFT's switch interval): turn
    `step // switch_every` picks it. `adaptive` visits every block once, then picks the block with the largest EMA
    of its gradient norm weighted by how many turns it has waited, `ema * (1 + waited / K)`; a block idle for 2K
    turns is taken regardless, so none starves. The schedule is a pure function of its state, so `state_dict()` is
    all a checkpoint needs.
    """

    def __init__(self, num_blocks: int, kind: str = "cyclic", seed: int = 0, switch_every: int = 1):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
        if switch_every < 1:
            raise ValueError(f"switch_every must be at least 1, got {switch_every}")
        self.num_blocks, self.kind, self.switch_every = num_blocks, kind, switch_every
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self.current = -1
        self.order: list[int] = []
        self.grad_ema = [0.0] * num_blocks
        self.last_turn = [-1] * num_blocks

    def observe(self, block: int, grad_norm: float) -> None:
        """Record the gradient norm the block had on its step (used by `adaptive`)."""
        previous = self.grad_ema[block]
        self.grad_ema[block] = grad_norm if previous == 0.0 else EMA * previous + (1 - EMA) * grad_norm

    def next_block(self) -> int:
        """The block for the current step; advances the schedule by one step."""
        if self.step % self.switch_every == 0:
            self.current = self._pick(self.step // self.switch_every)
        self.step += 1
        return self.current

    def _pick(self, turn: int) -> int:
        if self.kind == "adaptive" and turn >= self.num_blocks:
            block = self._adaptive_block(turn)
        else:
            block = self._ordered_block(turn)
        self.last_turn[block] = turn
        return block

    def _adaptive_block(self, turn: int) -> int:
        waited = [turn - last for last in self.last_turn]
        starving = [b for b in range(self.num_blocks) if waited[b] >= 2 * self.num_blocks]
        if starving:
            return max(starving, key=lambda b: waited[b])
        return max(range(self.num_blocks), key=lambda b: self.grad_ema[b] * (1 + waited[b] / self.num_blocks))

    def _ordered_block(self, turn: int) -> int:
        position = turn % self.num_blocks
        if position == 0 or not self.order:
            self.order = self._cycle_order()
        return self.order[position]

    def _cycle_order(self) -> list[int]:
        if self.kind in ("cyclic", "adaptive"):
            return list(range(self.num_blocks))
        if self.kind == "reverse":
            return list(reversed(range(self.num_blocks)))
        return torch.randperm(self.num_blocks, generator=self.generator).tolist()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "current": self.current,
            "order": list(self.order),
            "rng": self.generator.get_state(),
            "grad_ema": list(self.grad_ema),
            "last_step": list(self.last_turn),
        }

    def load_state_dict(self, state: dict) -> None:
        """`last_step` keeps its name from before turns existed: with switch_every 1 a turn is a step."""
        self.step, self.order = int(state["step"]), [int(b) for b in state["order"]]
        self.current = int(state.get("current", -1))
        self.generator.set_state(state["rng"])
        self.grad_ema = [float(x) for x in state["grad_ema"]]
        self.last_turn = [int(x) for x in state["last_step"]]
