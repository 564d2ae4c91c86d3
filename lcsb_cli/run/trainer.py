"""One optimizer step: grad_accum micro-batches, the method's hooks, the divergence guard, a metrics row."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backends import Backend
from ..data.batching import BatchStream
from ..errors import BadInput
from ..methods import Method
from ..model.losses import causal_lm_loss
from ..objectives import PreferenceObjective
from .distributed import SINGLE, World
from .divergence import Divergence


def target_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@dataclass
class Trainer:
    """One optimizer step per call: grad_accum micro-batches, loss normalised per target token of the step."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    method: Method
    # .batch(index) -> dict of tensors; a pure function of index
    batches: BatchStream
    backend: Backend
    grad_accum: int
    max_grad_norm: float
    # none | bf16: train.autocast as the run's entry point resolved it
    autocast: str
    # the guard, the states it returns to and the recipe's action (divergence.py)
    divergence: Divergence
    loss_fn: Callable = causal_lm_loss
    # data parallel: the loss and the active block's gradients are summed over ranks
    world: World = SINGLE
    # a preference objective (objectives/): the step's loss is its mean over examples, and its TRL-named metrics join
    # the row; None: sft, the loss per target token
    objective: PreferenceObjective | None = None

    def __post_init__(self):
        # event rows the backend raised (throttling, precision choice)
        self.notes: list[dict] = []

    def step(self, step: int) -> dict:
        """Run step number `step` (0-based) and return its metrics row."""
        start = time.perf_counter()
        self.backend.begin_step(step)
        active = self.method.begin_step()
        micro = [self._to_device(self.batches.batch(step * self.grad_accum + i)) for i in range(self.grad_accum)]
        count = self.objective.count if self.objective is not None else target_tokens
        n_targets = max(self.world.total(sum(count(b) for b in micro)), 1)
        # the schedule's rate: a group's own factor (lcsb.lr_scale) is not part of it
        lr = self.lr_scheduler.get_last_lr()[0] / self.optimizer.param_groups[0].get("lr_scale", 1.0)
        if self.method.zeroth_order:
            loss, grad_norm, problem, timing = self._zeroth_order_update(micro, n_targets, lr)
        else:
            loss, grad_norm, problem, timing = self._backprop_update(micro, n_targets, active)
        outcome = self.divergence.handle(problem, self.lr_scheduler) if problem else {}
        self.lr_scheduler.step()
        self.backend.synchronize()
        device_metrics, notes = self.backend.end_step()
        self.notes += notes
        elapsed = time.perf_counter() - start
        tokens = int(self.world.total(sum(int(b["attention_mask"].sum()) for b in micro)))
        if self.divergence.cfg.snapshot == "disk":
            device_metrics["snapshot_write_mb"] = self.divergence.good.written_mb()
        return {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "peak_mem_mb": self.backend.peak_mem_mb(),
            "active_block": active,
            "method": self.method.name,
            **timing,
            **device_metrics,
            **outcome,
            **(self.objective.step_metrics() if self.objective is not None else {}),
        }

    def _backprop_update(self, micro: list[dict], n_targets: int, active: int | None):
        loss, timing = self._forward_backward(micro, n_targets)
        communicated = self.world.sync_grads(self.params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or math.inf))
        self.method.after_backward(active, grad_norm)
        problem = self.divergence.before_update(loss, grad_norm)
        if problem is None:
            self.method.before_optimizer_step(active)
            self.optimizer.step()
            problem = self.divergence.after_update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, problem, {**timing, **communicated}

    def _forward_backward(self, micro: list[dict], n_targets: int) -> tuple[float, dict]:
        """The step's loss (summed over ranks, per target) with every micro-batch's gradients accumulated."""
        loss = torch.zeros((), device=self.backend.device)
        forward_s = backward_s = 0.0
        for batch in micro:
            mark = time.perf_counter()
            with self.backend.autocast(self.autocast):
                summed = self.loss_fn(self.model, batch)
            self.backend.synchronize()
            forward_s += time.perf_counter() - mark
            mark = time.perf_counter()
            (summed / n_targets).backward()
            self.backend.synchronize()
            backward_s += time.perf_counter() - mark
            loss += summed.detach()
        return self.world.total(float(loss)) / n_targets, {"forward_s": forward_s, "backward_s": backward_s}

    def _zeroth_order_update(self, micro: list[dict], n_targets: int, lr: float):
        def loss_at() -> float:
            with self.backend.autocast(self.autocast):
                return float(sum(self.loss_fn(self.model, batch) for batch in micro)) / n_targets

        self.divergence.before_zeroth_order_update()
        loss, grad_norm = self.method.zeroth_order_step(loss_at, lr)
        return loss, grad_norm, self.divergence.after_zeroth_order_update(loss, grad_norm), {}

    def state_dict(self) -> dict:
        return {
            "guard": self.divergence.guard.state_dict(),
            "backend": self.backend.state_dict(),
            "world_size": self.world.size,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("world_size", 1)
        if saved != self.world.size:
            raise BadInput(
                f"--resume: the run was trained with {saved} process(es), this is {self.world.size}; "
                f"resume with --nproc {saved}"
            )
        self.divergence.guard.load_state_dict(state["guard"])
        self.backend.load_state_dict(state["backend"])
        self.divergence.reset()

    def begin(self) -> None:
        """Before the first step a process runs (the run's loop and the bench's workers alike): train mode, and the
        states a divergence returns to taken."""
        self.model.train()
        self.take_snapshots()

    def take_snapshots(self) -> None:
        """At the start, at every checkpoint save and right after a resume: the states a divergence returns to are
        the current one, so a resumed run returns where an uninterrupted one does."""
        self.divergence.take_snapshots()

    def take_notes(self) -> list[dict]:
        notes, self.notes = self.notes, []
        return notes

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.backend.device, non_blocking=True) for k, v in batch.items()}
