"""Which block of decoder layers trains at step t."""

from __future__ import annotations

import torch

SCHEDULES = ("cyclic", "reverse", "random")


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

    The schedule is a pure function of its state, so `state_dict()` is all a checkpoint needs.
    """

    def __init__(self, num_blocks: int, kind: str = "cyclic", seed: int = 0):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
        self.num_blocks, self.kind = num_blocks, kind
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self.order: list[int] = []

    def next_block(self) -> int:
        """The block for the current step; advances the schedule by one step."""
        position = self.step % self.num_blocks
        if position == 0 or not self.order:
            self.order = self._cycle_order()
        self.step += 1
        return self.order[position]

    def _cycle_order(self) -> list[int]:
        if self.kind == "cyclic":
            return list(range(self.num_blocks))
        if self.kind == "reverse":
            return list(reversed(range(self.num_blocks)))
        return torch.randperm(self.num_blocks, generator=self.generator).tolist()

    def state_dict(self) -> dict:
        return {"step": self.step, "order": list(self.order), "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.order = int(state["step"]), [int(b) for b in state["order"]]
        self.generator.set_state(state["rng"])
