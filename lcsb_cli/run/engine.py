"""One training run, read top to bottom: open the run dir, set up in dependency order, resume, loop, finish."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import get_scheduler

from .. import rundir
from ..atomic import write_json_atomic
from ..backends import get_backend
from ..data import TaskData, build_train_batches, load_task
from ..display import Phases
from ..errors import BadInput
from ..methods import build_method, check_layer_counts
from ..model import adapter as adapters
from ..model.load import load_model, lora_parameters
from ..model.losses import causal_lm_loss
from ..model.memory import breakdown, peak_rss_mb, rebased
from ..model.precision import prepare_for_autocast
from ..objectives import build_objective
from ..recipe import Recipe, resolved_autocast
from ..rundir import RunDir
from ..rundir.summary import summarize
from ..runtime import log_to
from . import warm
from .best import EARLY_STOPPING, BestWatch
from .distributed import SINGLE, World
from .divergence import Divergence
from .hooks import Display, Hook, Run, SilentDisplay, check_initial_loss, hooks_for
from .job import Job, owned_job, write_report
from .resume import resume_state, save_adapter
from .trainer import Trainer


def train_adapter(
    recipe: Recipe,
    run_dir: Path,
    display: Display,
    resume: bool = False,
    force: bool = False,
    adapter_dir: Path | None = None,
    job: Job | None = None,
    task: TaskData | None = None,
) -> dict:
    """Check the run dir, wait for the overnight window, set up, restore a checkpoint if resuming, claim the run
    dir, then run the steps until done or stopped (SIGTERM/SIGINT, window end, time limit: checkpointed, exit 0).

    One adapter: `data.user` is null or one user (`per_user` runs `all`, passing its `job` and each user's `task`).
    Nothing in `run_dir` changes until every check and the whole set-up have passed.
    """
    if recipe.data.user == "all":
        raise ValueError("train_adapter trains one adapter; run.entry.train runs data.user: all")
    recipe = warm.pinned(recipe, Path(run_dir), resume)
    request = RunRequest(recipe, Path(run_dir), resume, force, adapter_dir, task)
    try:
        # a user's run inside a per-user job: the job's owner waited for the window
        if job is not None:
            return _train(request, display, job, SINGLE, owner=False)
        with owned_job(recipe, request.run_dir) as (job, world):
            return _train(request, display if world.is_main else SilentDisplay(), job, world, owner=True)
    finally:
        # the run's log file closes with the run
        log_to(None)


@dataclass(frozen=True)
class RunRequest:
    """What one `train` call asked for."""

    recipe: Recipe
    run_dir: Path
    resume: bool
    force: bool
    adapter_dir: Path | None
    task: TaskData | None


def _train(request: RunRequest, display: Display, job: Job, world: World, owner: bool) -> dict:
    started = time.perf_counter()
    recipe, run_dir = request.recipe, request.run_dir

    def setup() -> tuple[Run, int]:
        trainer, loaded, task_data = build_trainer(recipe, world, request.task, RunDir(run_dir).snapshot(world.rank))
        # a resume takes the trained adapter from its checkpoint, never the starting one again
        if recipe.lora.init is not None and not request.resume:
            warm.start_from(recipe, loaded.model)
        if trainer.objective is not None:
            _prepare_reference(trainer, run_dir, recipe.lora.init is not None, display)
        first_step, wall_before, notes, best = resume_state(run_dir, trainer) if request.resume else (0, 0.0, [], None)
        run = Run(
            recipe,
            run_dir,
            trainer,
            loaded,
            task_data,
            job,
            display,
            request.adapter_dir or RunDir(run_dir).adapter,
            first_step,
            wall_before,
            notes,
            watch=BestWatch.for_recipe(recipe.train),
        )
        if run.watch is not None and best is not None:
            run.watch.load_state_dict(best)
        check_initial_loss(run)
        return run, first_step

    with rundir.opened_run(run_dir, recipe, request.resume, request.force, world, setup, job if owner else None) as run:
        if run is None:
            return {"stopped": job.signals.requested, "steps": 0}
        run.load_time_s = time.perf_counter() - started
        return _run_claimed(run)


def _run_claimed(run: Run) -> dict:
    """The run once its dir is claimed: before-eval of an overnight job, the loop, the finish."""
    run.display.on_start(
        {
            "recipe": run.recipe,
            "run_dir": run.run_dir,
            "first_step": run.first_step,
            "notes": run.notes,
            "blocks": run.trainer.method.blocks,
            "params": sum(p.numel() for p in run.trainer.params),
            "layers": len(run.loaded.layers),
        }
    )
    if run.world.is_main and run.trainer.objective is not None:
        run.trainer.objective.save(run.run_dir)
    if run.world.is_main and run.recipe.overnight.report and run.job.state["eval_before"] is None:
        run.job.state["eval_before"] = run.held_out_metrics()
    try:
        run_steps(run, hooks_for(run))
        summary = _finish(run)
    except BaseException:
        # the trackers' runs end as failed
        run.log.close(None)
        raise
    run.log.close(summary)
    run.display.on_end(summary)
    # no rank leaves before rank 0 has written the run's files
    run.world.barrier()
    if run.diverged:
        raise run.diverged
    return summary


def build_trainer(
    recipe: Recipe, world: World = SINGLE, task: TaskData | None = None, snapshot_dir: Path | None = None
):
    """Set up in dependency order: threads and seed, backend, model, data (loaded once; this rank's shard), the
    method with its optimizer (built over all LoRA parameters before any block is frozen), LR schedule.
    `snapshot_dir`: where divergence.snapshot disk keeps its files (a temporary dir when None)."""
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    torch.manual_seed(recipe.train.seed)
    backend = get_backend(recipe.backend, recipe.npu_sim)
    with world.main_first():
        loaded = load_model(recipe, backend.device)
    check_layer_counts(recipe, len(loaded.layers))
    # auto resolved once: the frozen weights' storage and every forward of the run (trainer.autocast) follow it
    autocast = resolved_autocast(recipe)
    prepare_for_autocast(loaded.model, autocast, recipe)
    backend.prepare(loaded)
    task = load_task(recipe, loaded.tokenizer) if task is None else task
    if recipe.train.eval_every or recipe.overnight.report:
        task.need_held_out()
    batches = build_train_batches(recipe, loaded.tokenizer, task, (world.rank, world.size))
    params = lora_parameters(loaded.model)
    method, optimizer = build_method(recipe, loaded.model, loaded.layers, params)
    # transformers' plain "constant" would skip the warmup the recipe asks for
    lr_scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(recipe.train.lr_scheduler, recipe.train.lr_scheduler),
        optimizer,
        num_warmup_steps=recipe.train.warmup_steps,
        num_training_steps=recipe.train.max_steps,
    )
    objective = build_objective(recipe)
    trainer = Trainer(
        model=loaded.model,
        params=params,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        method=method,
        batches=batches,
        backend=backend,
        grad_accum=recipe.train.grad_accum,
        max_grad_norm=recipe.train.max_grad_norm,
        autocast=autocast,
        divergence=Divergence(recipe.divergence, params, optimizer, snapshot_dir),
        loss_fn=functools.partial(causal_lm_loss, probe=loaded.probe) if objective is None else objective.loss,
        world=world,
        objective=objective,
    )
    return trainer, loaded, task


def _prepare_reference(trainer: Trainer, run_dir: Path, warm_start: bool, display: Display) -> None:
    """The preference objective's reference log-probs, before step 1: read back from the run dir, or computed over
    every training example in batches of train.batch_size (a progress bar), under the run's autocast."""
    stream, backend = trainer.batches, trainer.backend
    rows, size = stream.dataset, stream.batch_size
    batches = (
        {k: v.to(backend.device) for k, v in stream.collate_fn(rows[i : i + size], stream.pad_id).items()}
        for i in range(0, len(rows), size)
    )
    phase = Phases(display.console) if hasattr(display, "console") else None
    with backend.autocast(trainer.autocast):
        trainer.objective.prepare(trainer.model, batches, len(rows), run_dir, warm_start, phase)


def run_steps(run: Run, hooks: list[Hook]) -> None:
    """Step until max_steps, a stop (signal, window end, time limit) or a divergence that stops the run."""
    run.trainer.begin()
    run.done = run.first_step
    for hook in hooks:
        hook.at_start(run)
    # after the trackers have started (StepLog): their start-up is not training time
    run.started = time.perf_counter()
    for step in range(run.first_step, run.recipe.train.max_steps):
        for hook in hooks:
            hook.before_step(run, step)
        if run.stopped:
            break
        row = _guarded_step(run, step)
        run.done = step + 1
        for hook in hooks:
            hook.after_step(run, row)
        if run.diverged:
            break
    for hook in hooks:
        hook.at_end(run)


def _finish(run: Run) -> dict:
    """Rank 0: the adapter, summary.json, job.json and the report. Other ranks only return their step count."""
    if not run.world.is_main:
        return {"steps": run.done, "rank": run.world.rank}
    # no snapshot: the weights are the diverged
    if not (run.diverged and run.recipe.divergence.snapshot == "none"):
        _save_adapters(run)
    summary = summarize(rundir.read_metrics(RunDir(run.run_dir).metrics), run.trainer.method, run.wall_time_s())
    summary["diverged"] = run.diverged is not None
    summary["memory"] = breakdown(
        run.loaded.model, run.loaded.probe, run.loaded.runtime_mb, run.trainer.backend.held_weights()
    )
    summary.update(load_time_s=run.load_time_s, run_dir=str(run.run_dir), adapter=str(run.adapter_dir))
    summary.update(warm.summary_fields(run.recipe, run.loaded.model))
    if run.watch is not None and run.watch.keep:
        summary["adapter_last"] = str(RunDir(run.run_dir).adapter_last)
    if run.world.size > 1:
        summary["world_size"] = run.world.size
    if run.watch is not None:
        summary.update(run.watch.summary())
    if run.stopped == EARLY_STOPPING:
        summary["early_stopped"] = {"step": run.done, "reason": run.watch.reason()}
    elif run.stopped:
        summary["stopped"] = run.stopped
        run.job.interrupted(run.done, run.stopped)
    if run.recipe.overnight.report:
        # asked to go: exit now, evaluate when the run finishes
        signalled = run.stopped in ("SIGTERM", "SIGINT")
        summary["eval_before"] = run.job.state["eval_before"]
        summary["eval_after"] = None if signalled else run.held_out_metrics()
        write_report(
            run.run_dir, run.recipe, run.job.state, summary, summary["eval_after"], run.adapter_dir, run.task.skipped
        )
    # one peak: the process's, the overnight evaluation included, which the breakdown splits
    summary["memory"] = rebased(summary["memory"], peak_rss_mb())
    if run.trainer.backend.device.type == "cpu":
        summary["peak_mem_mb"] = summary["memory"]["peak_rss_mb"]
    write_json_atomic(RunDir(run.run_dir).summary, summary)
    run.job.save()
    return summary


def _save_adapters(run: Run) -> None:
    """The adapter; with train.keep_best the last goes to adapter-last/ and the best (the last when no evaluation has
    run) to the adapter dir, and the model holds the best from here on (the overnight report evaluates it)."""
    if run.watch is None or not run.watch.keep:
        save_adapter(run.loaded.model, run.adapter_dir)
        return
    save_adapter(run.loaded.model, RunDir(run.run_dir).adapter_last)
    if run.watch.adapter is not None:
        adapters.apply(run.loaded.model, run.watch.adapter, f"the best adapter (step {run.watch.best_step})")
    save_adapter(run.loaded.model, run.adapter_dir)


def _guarded_step(run: Run, step: int) -> dict:
    """One step; running out of memory is the user's to fix (batch, length, K, checkpointing, quantization)."""
    try:
        return run.trainer.step(step)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _is_allocation_failure(exc):
            raise
        peak = run.trainer.backend.peak_mem_mb()
        raise BadInput(
            f"out of memory at step {step + 1} (peak {peak:.0f} MB, batch {run.recipe.train.batch_size} x up to "
            f"{run.recipe.data.max_length} tokens): lower train.batch_size or data.max_length, set "
            "activation_checkpointing=true, raise lcsb.blocks, or quantize (quantization=nf4)"
        ) from exc


def _is_allocation_failure(exc: RuntimeError) -> bool:
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text.lower()
