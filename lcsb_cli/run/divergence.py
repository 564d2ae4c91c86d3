"""Divergence policy: detect non-finite or spiking losses; stop, skip the update, or roll back."""

from __future__ import annotations

import hashlib
import math
import statistics
import tempfile
from collections import deque
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..atomic import write_file

# good losses the spike test takes its running median over
WINDOW = 20


class MemorySnapshot:
    """The snapshot as copies in memory, refilled in place (one fused copy) while its tensors stay the same."""

    written_bytes = 0

    def __init__(self):
        self.copies: list[torch.Tensor] | None = None
        # the groups' tensors, flattened once per new set of groups
        self.sources: list[torch.Tensor] = []

    def write(self, groups: list[dict[str, torch.Tensor]], fresh: bool) -> None:
        if fresh or self.copies is None:
            # the old copies go before the new ones are made
            self.copies = None
            self.sources = [t for group in groups for t in group.values()]
            self.copies = [t.clone() for t in self.sources]
        else:
            torch._foreach_copy_(self.copies, self.sources)

    def read_into(self, groups: list[dict[str, torch.Tensor]]) -> None:
        torch._foreach_copy_(self.sources, self.copies)


class DiskSnapshot:
    """The snapshot on disk, out of RAM: one safetensors file per LoRA parameter (its weights and optimizer state),
    each written atomically and only when its bytes changed since the last write (a digest per file), so a phone's
    flash is spared rewriting what did not move. `written_bytes` counts what went to disk."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.digests: dict[int, bytes] = {}
        self.written_bytes = 0

    def write(self, groups: list[dict[str, torch.Tensor]], fresh: bool) -> None:
        if fresh:
            self.digests = {}
        for index, group in enumerate(groups):
            digest = _digest(group)
            if self.digests.get(index) != digest:
                write_file(self.directory / f"{index}.safetensors", lambda tmp, group=group: save_file(group, tmp))
                self.digests[index] = digest
                self.written_bytes += sum(t.nbytes for t in group.values())

    def read_into(self, groups: list[dict[str, torch.Tensor]]) -> None:
        for index, group in enumerate(groups):
            saved = load_file(self.directory / f"{index}.safetensors")
            for key, tensor in group.items():
                tensor.copy_(saved[key])


def _digest(group: dict[str, torch.Tensor]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for tensor in group.values():
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.digest()


def make_snapshot(kind: str, directory: Path | None) -> MemorySnapshot | DiskSnapshot | None:
    """divergence.snapshot: memory | disk (in `directory`, a temporary one when None) | none."""
    if kind == "memory":
        return MemorySnapshot()
    if kind == "disk":
        return DiskSnapshot(directory or Path(tempfile.mkdtemp(prefix="lcsb-snapshot-")))
    return None


class GoodState:
    """The state to return to: LoRA weights, AdamW moments and step counts, plus optimizer state held as plain
    numbers (bitsandbytes' AdamW8bit counts its steps in a Python int), kept by a snapshot (`MemorySnapshot`,
    `DiskSnapshot`; None keeps nothing: divergence.snapshot none, whose recipe must stop on divergence). The LR
    schedule and the method's block schedule are not part of it: they count steps with the data, so after a
    rollback the cosine still ends at max_steps and the block order stays t mod K.

    The trainer takes it just before an update whose loss was clean or opened a run of spikes, so a rollback or
    skip lands before the run of spikes; at every checkpoint save and right after a resume, so a resumed run
    returns to the same state as an uninterrupted one (never behind the last checkpoint)."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer, snapshot: MemorySnapshot | DiskSnapshot | None):
        self.params, self.optimizer, self.snapshot = params, optimizer, snapshot
        # per parameter: the tensors the snapshot mirrors
        self.groups: list[dict[str, torch.Tensor]] | None = None
        self.with_state: list[torch.nn.Parameter] = []
        # (parameter, state key) of optimizer state that is not a tensor
        self.number_keys: list[tuple] = []
        # their values
        self.numbers: list = []
        self.reported_bytes = 0

    def reset(self) -> None:
        """Forget what the snapshot mirrors, e.g. after the optimizer's state was replaced by a checkpoint's."""
        self.groups = None

    def _gather(self) -> list[dict[str, torch.Tensor]]:
        state = self.optimizer.state
        return [
            {"weight": p.data, **{k: v for k, v in sorted(state[p].items()) if torch.is_tensor(v)}}
            if p in state
            else {"weight": p.data}
            for p in self.params
        ]

    def take(self) -> None:
        if self.snapshot is None:
            return
        fresh = self.groups is None or len(self.optimizer.state) != len(self.with_state)
        if fresh:
            self.with_state = [p for p in self.params if p in self.optimizer.state]
            self.groups = self._gather()
            self.number_keys = [
                (p, k) for p in self.with_state for k, v in self.optimizer.state[p].items() if not torch.is_tensor(v)
            ]
        self.snapshot.write(self.groups, fresh)
        # empty for torch's AdamW
        self.numbers = [self.optimizer.state[p][k] for p, k in self.number_keys]

    def restore(self) -> None:
        keep = set(map(id, self.with_state))
        for p in [p for p in self.optimizer.state if id(p) not in keep]:
            del self.optimizer.state[p]
        self.snapshot.read_into(self.groups)
        for (p, key), value in zip(self.number_keys, self.numbers):
            self.optimizer.state[p][key] = value

    def written_mb(self) -> float:
        """MiB the snapshot wrote to disk since the last call."""
        written = self.snapshot.written_bytes if self.snapshot is not None else 0
        new, self.reported_bytes = written - self.reported_bytes, written
        return new / 2**20


class DivergenceGuard:
    """Says whether a step diverged: a non-finite loss or gradient norm, a loss above `spike_factor` x the running
    median of recent good losses for `patience` steps in a row, or a slow climb: the mean of the last `climb_window`
    good losses `climb_nats` above the lowest such mean so far (0 turns the climb test off). The spike test alone
    cannot see a climb, because its median climbs with the loss; the climb is measured in nats (a perplexity ratio),
    not as a ratio of losses, which near zero a healthy run's noise reaches. `improved` says whether this step's loss
    set a new lowest mean, `climbed` whether the last divergence was a climb."""

    def __init__(self, spike_factor: float, patience: int, climb_nats: float = 0.0, climb_window: int = 10):
        self.spike_factor, self.patience, self.climb_nats = spike_factor, patience, climb_nats
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.spikes = 0
        self.window: deque[float] = deque(maxlen=climb_window)
        self.best_mean = math.inf
        self.improved = self.climbed = False

    def check(self, loss: float, grad_norm: float) -> str | None:
        self.improved = self.climbed = False
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if len(self.recent) >= 3 and loss > self.spike_factor * statistics.median(self.recent):
            self.spikes += 1
            if self.spikes >= self.patience:
                self.spikes = 0
                return (
                    f"loss {loss:.4g} above {self.spike_factor}x the running median "
                    f"{statistics.median(self.recent):.4g} for {self.patience} steps"
                )
            return None
        self.spikes = 0
        self.recent.append(loss)
        return self._climb(loss)

    def _climb(self, loss: float) -> str | None:
        if not self.climb_nats:
            return None
        self.window.append(loss)
        if len(self.window) < self.window.maxlen:
            return None
        mean = statistics.fmean(self.window)
        if mean < self.best_mean:
            self.best_mean, self.improved = mean, True
        elif mean > self.best_mean + self.climb_nats:
            self.window.clear()
            self.climbed = True
            return (
                f"loss climbed: the mean of the last {self.window.maxlen} steps, {mean:.4g}, is "
                f"{mean - self.best_mean:.3g} nats above its lowest, {self.best_mean:.4g}"
            )
        return None

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "spikes": self.spikes, "window": list(self.window), "best": self.best_mean}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((float(x) for x in state["recent"]), maxlen=WINDOW)
        self.spikes = int(state["spikes"])
        # checkpoints written before the climb test have neither
        self.window = deque((float(x) for x in state.get("window", [])), maxlen=self.window.maxlen)
        self.best_mean = float(state.get("best", math.inf))


def all_finite(params: list[torch.Tensor]) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(params))).all())


def scale_lr(optimizer, lr_scheduler, factor: float) -> None:
    """Scale the learning rate for the rest of the run (the schedule's base rates and the current rates)."""
    lr_scheduler.base_lrs = [lr * factor for lr in lr_scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor


class Divergence:
    """Everything a step does about divergence, kept out of the step's body: the guard's verdict, the states a
    divergence returns to (`good`: before the update that opened a run of spikes; `best`: at the lowest mean loss,
    for a slow climb) and the recipe's action on a divergence."""

    def __init__(self, cfg, params: list[torch.nn.Parameter], optimizer, snapshot_dir: Path | None):
        self.cfg, self.params, self.optimizer = cfg, params, optimizer
        self.guard = DivergenceGuard(cfg.spike_factor, cfg.patience, cfg.climb_nats, cfg.climb_window)
        self.good = GoodState(params, optimizer, make_snapshot(cfg.snapshot, snapshot_dir))
        # a climb returns to the state at the lowest mean loss (or the last checkpoint, when later)
        best_dir = snapshot_dir / "best" if snapshot_dir is not None else None
        climbs = cfg.climb_nats > 0 and cfg.snapshot != "none"
        self.best = GoodState(params, optimizer, make_snapshot(cfg.snapshot if climbs else "none", best_dir))
        # whether updates since the snapshot belong to the divergence being handled
        self.suspect = False

    def before_update(self, loss: float, grad_norm: float) -> str | None:
        """The verdict on a backprop step's loss before its update; a clean step (or the first of a run of spikes)
        first takes the state to return to."""
        # updates of a run of spikes are in the weights
        self.suspect = self.guard.spikes > 0
        problem = self.guard.check(loss, grad_norm)
        if problem is None:
            if self.guard.spikes <= 1:
                self.good.take()
            if self.guard.improved:
                self.best.take()
        return problem

    def after_update(self) -> str | None:
        if all_finite(self.params):
            return None
        self.suspect = True
        return "the update made the weights non-finite"

    def before_zeroth_order_update(self) -> None:
        if self.guard.spikes == 0:
            self.good.take()
        # the update is applied before its loss is judged
        self.suspect = True

    def after_zeroth_order_update(self, loss: float, grad_norm: float) -> str | None:
        problem = self.guard.check(loss, grad_norm)
        if problem is None and not all_finite(self.params):
            problem = "the update made the weights non-finite"
        if problem is None and self.guard.improved:
            # the state after the update whose perturbed losses set the lowest mean
            self.best.take()
        return problem

    def handle(self, problem: str, lr_scheduler) -> dict:
        """Apply divergence.action. skip drops the updates the divergence made (a run of spikes, an update that
        made the weights non-finite) by returning to the snapshot before them; a non-finite loss found before its
        update leaves the weights as they are. rollback and stop always return to the snapshot, and rollback scales
        the learning rate for the rest of the run; after a slow climb every action returns to the state at the
        lowest mean loss (or the last checkpoint, when later). The LR and block schedules keep counting with the
        data."""
        action, kept = self.cfg.action, self.cfg.snapshot != "none"
        if self.guard.climbed and kept:
            self.best.restore()
        elif (action != "skip" or self.suspect) and kept:
            self.good.restore()
        if action == "rollback":
            scale_lr(self.optimizer, lr_scheduler, self.cfg.lr_backoff)
            return {"event": "rollback", "reason": problem}
        return {"event": "diverged", "reason": problem}

    def take_snapshots(self) -> None:
        self.good.take()
        self.best.take()

    def reset(self) -> None:
        self.good.reset()
        self.best.reset()
