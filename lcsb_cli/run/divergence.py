"""Divergence policy: detect non-finite or spiking losses; stop, skip the update, or roll back."""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

WINDOW = 20  # good losses the spike test takes its running median over


class GoodState:
    """The state to return to, in preallocated buffers: LoRA weights, AdamW moments and step counts (one fused
    copy per step), plus optimizer state held as plain numbers (bitsandbytes' AdamW8bit counts its steps in a
    Python int). The LR schedule and the method's block schedule are not part of it: they count steps with the
    data, so after a rollback the cosine still ends at max_steps and the block order stays t mod K.

    The trainer takes it just before an update whose loss was clean or opened a run of spikes, so a rollback or
    skip lands before the run of spikes; at every checkpoint save and right after a resume, so a resumed run
    returns to the same state as an uninterrupted one (never behind the last checkpoint)."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer):
        self.params, self.optimizer = params, optimizer
        self.buffers: list[torch.Tensor] | None = None
        self.live: list[torch.Tensor] = []  # the tensors the buffers mirror (AdamW updates them in place)
        self.with_state: list[torch.nn.Parameter] = []
        self.number_keys: list[tuple] = []  # (parameter, state key) of optimizer state that is not a tensor
        self.numbers: list = []  # their values

    def reset(self) -> None:
        """Forget the buffers, e.g. after the optimizer's state was replaced by a checkpoint's."""
        self.buffers = None

    def _gather(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        moments = [state[p][k] for p in self.with_state for k in sorted(state[p]) if torch.is_tensor(state[p][k])]
        return [p.data for p in self.params] + moments

    def take(self) -> None:
        if self.buffers is None or len(self.optimizer.state) != len(self.with_state):
            self.buffers = None  # the old copies go before the new ones are made
            self.with_state = [p for p in self.params if p in self.optimizer.state]
            self.live = self._gather()
            self.buffers = [t.clone() for t in self.live]
            self.number_keys = [(p, k) for p in self.with_state for k, v in self.optimizer.state[p].items()
                                if not torch.is_tensor(v)]
        else:
            torch._foreach_copy_(self.buffers, self.live)
        self.numbers = [self.optimizer.state[p][k] for p, k in self.number_keys]  # empty for torch's AdamW

    def restore(self) -> None:
        keep = set(map(id, self.with_state))
        for p in [p for p in self.optimizer.state if id(p) not in keep]:
            del self.optimizer.state[p]
        torch._foreach_copy_(self.live, self.buffers)
        for (p, key), value in zip(self.number_keys, self.numbers):
            self.optimizer.state[p][key] = value


class DivergenceGuard:
    """Says whether a step diverged: a non-finite loss or gradient norm, or a loss above `spike_factor` x the
    running median of recent good losses for `patience` steps in a row."""

    def __init__(self, spike_factor: float, patience: int):
        self.spike_factor, self.patience = spike_factor, patience
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.spikes = 0

    def check(self, loss: float, grad_norm: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if len(self.recent) >= 3 and loss > self.spike_factor * statistics.median(self.recent):
            self.spikes += 1
            if self.spikes >= self.patience:
                self.spikes = 0
                return (f"loss {loss:.4g} above {self.spike_factor}x the running median "
                        f"{statistics.median(self.recent):.4g} for {self.patience} steps")
            return None
        self.spikes = 0
        self.recent.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((float(x) for x in state["recent"]), maxlen=WINDOW)
        self.spikes = int(state["spikes"])


def all_finite(params: list[torch.Tensor]) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(params))).all())


def scale_lr(optimizer, lr_scheduler, factor: float) -> None:
    """Scale the learning rate for the rest of the run (the schedule's base rates and the current rates)."""
    lr_scheduler.base_lrs = [lr * factor for lr in lr_scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
