"""The training loop: steps, metrics, non-finite guard, checkpoints and exact resume."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from transformers import get_scheduler

from ..atomic import write_json_atomic
from ..backends import Backend, get_backend
from ..data import build_train_batches, eval_questions, train_questions
from ..data.batching import BatchStream
from ..errors import BadInput, Diverged
from ..evaluate import evaluate_questions
from ..methods import Method, build_method
from ..model.load import load_model, lora_parameters
from ..model.losses import causal_lm_loss
from ..model.memory import breakdown, make_optimizer
from ..recipe import DivergenceConfig, Recipe, check_layer_counts
from . import rundir
from .distributed import SINGLE, World
from .divergence import DivergenceGuard, GoodState, all_finite, scale_lr
from .job import Job, owned_job, write_report
from .resume import resume_state, save_adapter, save_state
from .summary import summarize


def target_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


class Reporter(Protocol):
    def on_start(self, info: dict) -> None: ...
    def on_step(self, row: dict) -> None: ...
    def on_end(self, summary: dict) -> None: ...


class SilentReporter:
    """Ranks other than 0 show nothing."""

    def on_start(self, info: dict) -> None:
        pass

    def on_step(self, row: dict) -> None:
        pass

    def on_end(self, summary: dict) -> None:
        pass


@dataclass
class Trainer:
    """One optimizer step per call: grad_accum micro-batches, loss normalised per target token of the step."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    method: Method
    batches: BatchStream  # .batch(index) -> dict of tensors; a pure function of index
    backend: Backend
    grad_accum: int
    max_grad_norm: float
    autocast: str
    divergence: DivergenceConfig  # action, spike_factor, patience, lr_backoff
    loss_fn: Callable = causal_lm_loss
    world: World = SINGLE  # data parallel: the loss and the active block's gradients are summed over ranks

    def __post_init__(self):
        self.guard = DivergenceGuard(self.divergence.spike_factor, self.divergence.patience)
        self.good = GoodState(self.params, self.optimizer, self.lr_scheduler, self.method)
        self.notes: list[dict] = []  # event rows the backend raised (throttling, precision choice)

    def step(self, step: int) -> dict:
        """Run step number `step` (0-based) and return its metrics row."""
        start = time.perf_counter()
        self.backend.begin_step(step)
        active = self.method.begin_step()
        micro = [self._to_device(self.batches.batch(step * self.grad_accum + i)) for i in range(self.grad_accum)]
        n_targets = max(self.world.total(sum(target_tokens(b) for b in micro)), 1)
        lr = self.lr_scheduler.get_last_lr()[0]
        if self.method.zeroth_order:
            loss, grad_norm, problem, timing = self._zeroth_order_update(micro, n_targets, lr)
        else:
            loss, grad_norm, problem, timing = self._backprop_update(micro, n_targets, active)
        outcome = self._handle(problem) if problem else {}
        self.lr_scheduler.step()
        self.backend.synchronize()
        device_metrics, notes = self.backend.end_step()
        self.notes += notes
        elapsed = time.perf_counter() - start
        tokens = int(self.world.total(sum(int(b["attention_mask"].sum()) for b in micro)))
        return {
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed, "peak_mem_mb": self.backend.peak_mem_mb(),
            "active_block": active, "method": self.method.name, **timing, **device_metrics, **outcome,
        }

    def _backprop_update(self, micro: list[dict], n_targets: int, active: int | None):
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
        loss = self.world.total(float(loss)) / n_targets
        communicated = self.world.sync_grads(self.params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or math.inf))
        self.method.after_backward(active, grad_norm)
        problem = self.guard.check(loss, grad_norm)
        if problem is None:
            if self.guard.spikes == 0:
                self.good.take()  # weights and moments that just gave a clean loss: the state to roll back to
            self.method.before_optimizer_step(active)
            self.optimizer.step()
            if not all_finite(self.params):
                problem = "the update made the weights non-finite"
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, problem, {"forward_s": forward_s, "backward_s": backward_s, **communicated}

    def _zeroth_order_update(self, micro: list[dict], n_targets: int, lr: float):
        def loss_at() -> float:
            with self.backend.autocast(self.autocast):
                return float(sum(self.loss_fn(self.model, batch) for batch in micro)) / n_targets

        if self.guard.spikes == 0:
            self.good.take()
        loss, grad_norm = self.method.zeroth_order_step(loss_at, lr)
        problem = self.guard.check(loss, grad_norm)
        if problem is None and not all_finite(self.params):
            problem = "the update made the weights non-finite"
        return loss, grad_norm, problem, {}

    def _handle(self, problem: str) -> dict:
        """Apply the divergence action; the update of the offending step never stays in the weights."""
        action = self.divergence.action
        if action == "skip" and all_finite(self.params):
            return {"event": "diverged", "reason": problem}
        self.good.restore()
        if action == "rollback":
            scale_lr(self.optimizer, self.lr_scheduler, self.divergence.lr_backoff)
            return {"event": "rollback", "reason": problem}
        return {"event": "diverged", "reason": problem}

    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict(), "backend": self.backend.state_dict(), "world_size": self.world.size}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("world_size", 1)
        if saved != self.world.size:
            raise BadInput(f"--resume: the run was trained with {saved} process(es), this is {self.world.size}; "
                           f"resume with --nproc {saved}")
        self.guard.load_state_dict(state["guard"])
        self.backend.load_state_dict(state["backend"])
        self.good.reset()

    def take_notes(self) -> list[dict]:
        notes, self.notes = self.notes, []
        return notes

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.backend.device, non_blocking=True) for k, v in batch.items()}


def train(recipe: Recipe, run_dir: Path, reporter: Reporter, resume: bool = False, force: bool = False,
          adapter_dir: Path | None = None, job: Job | None = None) -> dict:
    """Check the run dir, wait for the overnight window, set up, restore a checkpoint if resuming, claim the run
    dir, then run the steps until done or stopped (SIGTERM/SIGINT, window end, time limit: checkpointed, exit 0).

    One adapter: `data.user` is null or one user (`per_user` runs `all`, passing its `job`).
    Nothing in `run_dir` changes until every check and the whole set-up have passed.
    """
    if recipe.data.user == "all":
        raise ValueError("engine.train trains one adapter; per_user.train_per_user runs data.user: all")
    run_dir = Path(run_dir)
    if job is None:
        with owned_job(recipe, run_dir) as (job, world):
            return _train(recipe, run_dir, reporter if world.is_main else SilentReporter(), resume, force,
                          adapter_dir, job, world, owner=True)
    return _train(recipe, run_dir, reporter, resume, force, adapter_dir, job, SINGLE, owner=False)


def _train(recipe, run_dir, reporter, resume, force, adapter_dir, job, world, owner) -> dict:
    if resume:
        rundir.check_resume(run_dir, recipe)
    else:
        rundir.check_fresh(run_dir, force)
    if owner and job.wait_for_window():
        return {"stopped": job.signals.requested, "steps": 0}
    trainer, loaded, held_out = build_trainer(recipe, world)
    first_step, wall_before, notes = resume_state(run_dir, trainer) if resume else (0, 0.0, [])
    world.barrier()  # every rank has checked the run dir before rank 0 writes into it
    if world.is_main:
        rundir.claim(run_dir, recipe, resume, first_step)
    if owner:
        job.load(resume)
    reporter.on_start({"recipe": recipe, "run_dir": run_dir, "first_step": first_step, "notes": notes,
                       "params": sum(p.numel() for p in trainer.params), "layers": len(loaded.layers)})
    return _run_steps(recipe, run_dir, trainer, loaded, held_out, reporter, first_step, wall_before,
                      adapter_dir or run_dir / "adapter", notes, job)


def build_trainer(recipe: Recipe, world: World = SINGLE):
    """Set up in dependency order: threads and seed, backend, model, data (this rank's shard), one AdamW over
    all LoRA parameters (built before any block is frozen), LR schedule, method."""
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    torch.manual_seed(recipe.train.seed)
    backend = get_backend(recipe)
    with world.main_first():
        loaded = load_model(recipe, backend.device)
    check_layer_counts(recipe, len(loaded.layers))
    backend.prepare(loaded)
    batches = build_train_batches(recipe, loaded.tokenizer, train_questions(recipe), (world.rank, world.size))
    held_out = eval_questions(recipe) if recipe.train.eval_every or recipe.overnight.report else []
    params = lora_parameters(loaded.model)
    lr = recipe.mezo.lr if recipe.method == "mezo" else recipe.train.lr
    optimizer = make_optimizer(recipe.train.optimizer, params, lr, recipe.train.weight_decay)
    lr_scheduler = get_scheduler(
        recipe.train.lr_scheduler, optimizer, num_warmup_steps=recipe.train.warmup_steps,
        num_training_steps=recipe.train.max_steps,
    )
    method = build_method(recipe, loaded.model, loaded.layers, optimizer)
    trainer = Trainer(
        loaded.model, params, optimizer, lr_scheduler, method, batches, backend, recipe.train.grad_accum,
        recipe.train.max_grad_norm, recipe.train.autocast, recipe.divergence,
        functools.partial(causal_lm_loss, probe=loaded.probe), world,
    )
    return trainer, loaded, held_out


def _run_steps(recipe, run_dir, trainer, loaded, held_out, reporter, first_step, wall_before, adapter_dir,
               notes, job) -> dict:
    """The step loop. With several ranks all step together; rank 0 alone logs, evaluates and saves."""
    main = trainer.world.is_main
    trainer.good.take()
    if main and recipe.overnight.report and job.state["eval_before"] is None:
        job.state["eval_before"] = _held_out_metrics(loaded, held_out, recipe)
    loaded.model.train()
    started = time.perf_counter()
    cfg = recipe.train
    diverged = stopped = None
    done = first_step
    with open(run_dir / "metrics.jsonl" if main else os.devnull, "a") as log:
        for note in notes:
            log.write(_json_line(note))
        for step in range(first_step, cfg.max_steps):
            stopped = _agreed_stop(job, trainer.world)
            if stopped:
                break
            pause = job.cool_down(trainer.backend)
            if pause:
                log.write(_json_line({"step": step, "event": "throttled", **pause}))
            row = _guarded_step(trainer, step, recipe)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps or "event" in row:
                log.write(_json_line(row))
                log.flush()
                reporter.on_step(row)
            for note in trainer.take_notes():
                log.write(_json_line(note))
            if row.get("event") == "diverged" and recipe.divergence.action == "stop":
                diverged = Diverged(f"training diverged at step {done}: {row['reason']}; the last good state "
                                    f"is saved as checkpoints/step-{done}")
            elif main and cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.max_steps):
                metrics = _held_out_metrics(loaded, held_out, recipe)
                log.write(_json_line({"step": done, "eval_accuracy": metrics["accuracy"],
                                      "eval_f1": metrics["macro_f1"]}))
                log.flush()
                loaded.model.train()
            saved = (cfg.save_every and done % cfg.save_every == 0) or done == cfg.max_steps
            if main and (diverged or saved):
                save_state(run_dir, done, trainer, wall_before + time.perf_counter() - started)
            if diverged:
                break
        if main and stopped and done > first_step and not (cfg.save_every and done % cfg.save_every == 0):
            save_state(run_dir, done, trainer, wall_before + time.perf_counter() - started)
    wall = wall_before + time.perf_counter() - started
    summary = _finish(recipe, run_dir, trainer, loaded, held_out, adapter_dir, job, wall, diverged, stopped, done)
    reporter.on_end(summary)
    trainer.world.barrier()  # no rank leaves before rank 0 has written the run's files
    if diverged:
        raise diverged
    return summary


def _agreed_stop(job: Job, world: World) -> str | None:
    """This rank's reason to stop; with several ranks, all stop when any must."""
    reason = job.stop_reason()
    if world.size > 1 and world.any(reason is not None):
        return reason or "another rank stopped"
    return reason


def _finish(recipe, run_dir, trainer, loaded, held_out, adapter_dir, job, wall, diverged, stopped, done) -> dict:
    """Rank 0: the adapter, summary.json, job.json and the report. Other ranks only return their step count."""
    if not trainer.world.is_main:
        return {"steps": done, "rank": trainer.world.rank}
    save_adapter(loaded.model, adapter_dir)
    summary = summarize(rundir.read_metrics(run_dir / "metrics.jsonl"), trainer.method, wall)
    summary["diverged"] = diverged is not None
    summary["memory"] = breakdown(loaded.model, loaded.probe, loaded.runtime_mb, trainer.backend.held_weights())
    if trainer.world.size > 1:
        summary["world_size"] = trainer.world.size
    if stopped:
        summary["stopped"] = stopped
        job.interrupted(done, stopped)
    write_json_atomic(run_dir / "summary.json", summary)
    job.save()
    if recipe.overnight.report:
        signalled = stopped in ("SIGTERM", "SIGINT")  # asked to go: exit now, evaluate when the run finishes
        after = None if signalled else _held_out_metrics(loaded, held_out, recipe)
        write_report(run_dir, recipe, job.state, summary, after, adapter_dir)
    return summary


def _held_out_metrics(loaded, held_out, recipe: Recipe) -> dict:
    from ..evaluate import summary_row

    _, metrics = evaluate_questions(loaded.model, loaded.tokenizer, held_out, recipe)
    return summary_row(metrics)


def _guarded_step(trainer: Trainer, step: int, recipe: Recipe) -> dict:
    """One step; running out of memory is the user's to fix (batch, length, K, checkpointing, quantization)."""
    try:
        return trainer.step(step)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _is_allocation_failure(exc):
            raise
        peak = trainer.backend.peak_mem_mb()
        raise BadInput(
            f"out of memory at step {step + 1} (peak {peak:.0f} MB, batch {recipe.train.batch_size} x up to "
            f"{recipe.data.max_length} tokens): lower train.batch_size or data.max_length, set "
            "activation_checkpointing=true, raise lcsb.blocks, or quantize (quantization=nf4)"
        ) from exc


def _is_allocation_failure(exc: RuntimeError) -> bool:
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _json_line(row: dict) -> str:
    """Strict JSON: a NaN or infinite value is written as null (the row's reason says what it was)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}) + "\n"
