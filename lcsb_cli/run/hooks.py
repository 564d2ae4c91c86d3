"""A training run's context and the one-purpose hooks its step loop calls.

The loop (engine.run_steps) only steps the trainer; everything else happens in hooks, called in list order:
`at_start` once, `before_step` and `after_step` around each step, `at_end` once after the last. A hook
changes the run only through `run.stopped`, `run.diverged` and what it writes. Only rank 0 gets the hooks
that write (metrics log, periodic eval, the best adapter) and writes checkpoints; every rank gets job control, the
divergence stop and the checkpoint rule, so all ranks leave the loop, and snapshot for a rollback, at the same steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from ..data import TaskData
from ..errors import BadInput, Diverged
from ..evaluate import evaluate_items, summary_row
from ..model.load import LoadedModel, inference_mode
from ..model.losses import causal_lm_loss
from ..recipe import Recipe
from ..rundir import RunDir
from . import first_batch
from .best import EARLY_STOPPING, BestWatch
from .distributed import World
from .job import Job
from .resume import save_state
from .trackers import MetricsLog, open_trackers
from .trainer import Trainer


class Display(Protocol):
    def on_start(self, info: dict) -> None: ...
    def on_step(self, row: dict) -> None: ...
    def on_end(self, summary: dict) -> None: ...


class SilentDisplay:
    """Ranks other than 0 show nothing."""

    def on_start(self, info: dict) -> None:
        pass

    def on_step(self, row: dict) -> None:
        pass

    def on_end(self, summary: dict) -> None:
        pass


@dataclass
class Run:
    """Everything one training run holds, from set-up to finish."""

    recipe: Recipe
    run_dir: Path
    trainer: Trainer
    loaded: LoadedModel
    # training and held-out items (periodic eval, the before/after report)
    task: TaskData
    job: Job
    display: Display
    adapter_dir: Path
    # the checkpoint's step when resuming
    first_step: int = 0
    # training seconds before this process (resumed runs)
    wall_before: float = 0.0
    # checkpoints skipped as corrupt on resume
    notes: list[dict] = field(default_factory=list)
    # metrics.jsonl on rank 0 (StepLog opens it)
    log: MetricsLog = field(default_factory=MetricsLog)
    # steps finished
    done: int = 0
    # why the run stopped early: a signal, window_end, max_minutes, early_stopping (best.EARLY_STOPPING)
    stopped: str | None = None
    # train.keep_best / early_stopping_patience: the best held-out loss so far (restored on resume)
    watch: BestWatch | None = None
    # the last held-out row (PeriodicEval)
    held_out: dict | None = None
    # raised after the finish when divergence.action is stop
    diverged: Diverged | None = None
    # perf_counter when the loop started (run_steps sets it)
    started: float = 0.0
    # seconds from the command's start to the first step: model, data, checks
    load_time_s: float = 0.0

    @property
    def world(self) -> World:
        return self.trainer.world

    def wall_time_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def held_out_metrics(self, loss_only: bool = False) -> dict:
        """The held-out metrics (summary_row) under the training step's autocast (under bf16 the frozen weights are
        stored in bf16, model/precision.py); the model goes back to training mode."""
        with self.trainer.backend.autocast(self.trainer.autocast):
            _, metrics = evaluate_items(
                self.loaded.model,
                self.loaded.tokenizer,
                self.task.held_out,
                self.recipe,
                self.task.labels,
                loss_only=loss_only,
            )
        self.loaded.model.train()
        return summary_row(metrics)


class Hook:
    def at_start(self, run: Run) -> None:
        pass

    def before_step(self, run: Run, step: int) -> None:
        pass

    def after_step(self, run: Run, row: dict) -> None:
        pass

    def at_end(self, run: Run) -> None:
        pass


class JobControl(Hook):
    """Before each step: stop for a signal, the window's end or the time limit (all ranks agree), and pause while
    the device is hotter than overnight.max_temp_c."""

    def before_step(self, run: Run, step: int) -> None:
        # early stopping decided on rank 0: every rank stops with it
        reason = run.stopped or run.job.stop_reason()
        if run.world.size > 1 and run.world.any(reason is not None):
            reason = reason or "another rank stopped"
        if reason:
            run.stopped = reason
        elif pause := run.job.cool_down(run.trainer.backend):
            run.log.write({"step": step, "event": "throttled", **pause})


class StepLog(Hook):
    """Rank 0: opens metrics.jsonl and writes the resume's notes; then every log_every-th row, the last and any with
    an event, shown by the display too, and the backend's event rows beside them."""

    def at_start(self, run: Run) -> None:
        layout = RunDir(run.run_dir)
        # the engine closes it after the finish, so trackers get the summary
        run.log = MetricsLog(layout.metrics, open_trackers(run.recipe, layout))
        for note in run.notes:
            run.log.write(note)

    def after_step(self, run: Run, row: dict) -> None:
        cfg = run.recipe.train
        if run.done % cfg.log_every == 0 or run.done == cfg.max_steps or "event" in row:
            run.log.write(row)
            run.display.on_step(row)
        for note in run.trainer.take_notes():
            run.log.write(note)


class DivergenceStop(Hook):
    """divergence.action=stop: a diverged step ends the run (checkpointed, then exit code 3)."""

    def after_step(self, run: Run, row: dict) -> None:
        if row.get("event") == "diverged" and run.recipe.divergence.action == "stop":
            kept = (
                f"saved as checkpoints/step-{run.done}"
                if run.recipe.divergence.snapshot != "none"
                else "the last checkpoint (divergence.snapshot: none)"
            )
            run.diverged = Diverged(
                f"training diverged at step {run.done}: {row['reason']}; the last good state is {kept}"
            )


def check_initial_loss(run: Run) -> None:
    """train.check_initial_loss: in a fresh run's set-up, before the run dir is claimed, the model's loss over every
    token of its first batch. Above ln(vocab_size) + 1 it is worse than a uniform guess over the vocabulary, which
    an untrained model is not; the run stops before training (and before --force clears an old run). Every token, not
    only the step's few targets, so that a random-init model's spread around ln(vocab_size) cannot cross the bound.
    A passing run pays that one forward; above the bound, the loss on the shipped sample and the batch's words outside
    the vocabulary tell a sound base that does not know this text from a broken model (first_batch.py)."""
    if run.first_step or not run.recipe.train.check_initial_loss:
        return
    vocab = run.loaded.model.config.get_text_config().vocab_size
    batch, tokenizer = run.trainer.batches.batch(0), run.loaded.tokenizer
    summed, count = batch_loss(run, batch)
    loss = run.world.total(summed) / max(run.world.total(count), 1.0)
    if loss <= math.log(vocab) + 1:
        return
    summed, count = batch_loss(run, first_batch.sample_batch(tokenizer))
    lacking, words = (
        run.world.total(n) for n in first_batch.unknown_words(tokenizer, first_batch.batch_texts(tokenizer, batch))
    )
    share = lacking / words if words else None
    raise BadInput(first_batch.first_batch_problem(run.recipe.model.name, vocab, loss, summed / max(count, 1), share))


def batch_loss(run: Run, batch: dict) -> tuple[float, int]:
    """Summed next-token loss over every token of `batch` and the number of tokens it predicts, without gradients;
    in a packed batch a document's first token is not predicted from the document before it."""
    backend = run.trainer.backend
    batch = {k: v.to(backend.device) for k, v in batch.items()}
    unseen = batch["attention_mask"] == 0
    if "position_ids" in batch:
        unseen |= batch["position_ids"] == 0
    batch["labels"] = batch["input_ids"].masked_fill(unseen, -100)
    with inference_mode(run.loaded.model), backend.autocast(run.trainer.autocast):
        summed = float(causal_lm_loss(run.loaded.model, batch))
    return summed, int((batch["labels"][:, 1:] != -100).sum())


class PeriodicEval(Hook):
    """Rank 0, train.eval_every: a row of held-out metrics every N steps and after the last (eval_loss,
    eval_perplexity; eval_accuracy and eval_f1 for classification; eval_exact_match, eval_rouge1 and eval_rougeL
    for completion and chat)."""

    NAMES: ClassVar[dict[str, str]] = {
        "loss": "eval_loss",
        "perplexity": "eval_perplexity",
        "accuracy": "eval_accuracy",
        "macro_f1": "eval_f1",
        "exact_match": "eval_exact_match",
        "rouge1": "eval_rouge1",
        "rougeL": "eval_rougeL",
    }

    def after_step(self, run: Run, row: dict) -> None:
        every, done = run.recipe.train.eval_every, run.done
        last = done == run.recipe.train.max_steps
        if every and not run.diverged and (done % every == 0 or last):
            metrics = run.held_out_metrics(loss_only=run.recipe.train.eval_metrics == "loss" and not last)
            row = {"step": done, **{name: metrics[key] for key, name in self.NAMES.items() if key in metrics}}
            run.log.write(row)
            run.display.on_step(row)
            run.held_out = row


class KeepBest(Hook):
    """Rank 0, after PeriodicEval, with train.keep_best or train.early_stopping_patience: each held-out row's
    eval_loss goes to the run's BestWatch (the best adapter copied); after `patience` evaluations without an
    improvement of min_delta the run stops (an early_stopping row, then checkpointed like any stop)."""

    def at_start(self, run: Run) -> None:
        # resumed from the checkpoint of an early stop: the run is over
        if run.watch.exhausted:
            run.stopped = EARLY_STOPPING

    def after_step(self, run: Run, row: dict) -> None:
        held = run.held_out
        if held is None or held["step"] != run.done:
            return
        run.watch.update(run.done, held["eval_loss"], run.loaded.model)
        if run.watch.exhausted and run.done < run.recipe.train.max_steps:
            run.stopped = EARLY_STOPPING
            stop = {"step": run.done, "event": EARLY_STOPPING, "reason": run.watch.reason()}
            run.log.write(stop)
            run.display.on_step(stop)


class Checkpointer(Hook):
    """A checkpoint when `due`, when the run diverged, and when it stops at a step not yet saved. Every rank
    keeps the rule, so all take the divergence snapshot at the same steps; only rank 0 (`writes`) saves."""

    def __init__(self, save_every: int, max_steps: int, writes: bool):
        self.save_every, self.max_steps, self.writes = save_every, max_steps, writes
        self.saved_at: int | None = None

    def due(self, done: int) -> bool:
        return bool(self.save_every and done % self.save_every == 0) or done == self.max_steps

    def at_start(self, run: Run) -> None:
        # a resumed run's checkpoint is already on disk
        self.saved_at = run.first_step

    def after_step(self, run: Run, row: dict) -> None:
        if run.diverged and run.recipe.divergence.snapshot == "none":
            # nothing restored the weights: the last checkpoint stays the last good state
            return
        if self.due(run.done) or run.diverged:
            self._save(run)

    def at_end(self, run: Run) -> None:
        if run.stopped and run.done != self.saved_at:
            self._save(run)

    def _save(self, run: Run) -> None:
        if self.writes:
            best = run.watch.state_dict() if run.watch is not None else None
            save_state(run.run_dir, run.done, run.trainer, run.wall_time_s(), best)
        self.saved_at = run.done
        if run.done < self.max_steps and not (run.stopped or run.diverged):
            # what a run resumed here snapshots: both roll back to the same state
            run.trainer.take_snapshots()


def hooks_for(run: Run) -> list[Hook]:
    """Every rank controls the job, stops on divergence and keeps the checkpoint rule; rank 0 alone logs,
    evaluates and writes checkpoints."""
    cfg, main = run.recipe.train, run.world.is_main
    checkpointer = Checkpointer(cfg.save_every, cfg.max_steps, writes=main)
    if not main:
        return [JobControl(), DivergenceStop(), checkpointer]
    best = [KeepBest()] if run.watch is not None else []
    return [JobControl(), StepLog(), DivergenceStop(), PeriodicEval(), *best, checkpointer]
