"""Per-user runs (`data.user: all`): one adapter per user, users split across ranks when data parallel."""

from __future__ import annotations

import json
from pathlib import Path

from .. import rundir
from ..atomic import write_json_atomic
from ..data import user_tasks
from ..errors import Diverged
from ..model.memory import process_peak_rss_mb, rebased, release_freed_memory, reset_peak_rss
from ..model.tokenizer import shared_tokenizers
from ..recipe import Recipe, replace_key
from ..rundir import RunDir
from ..rundir.summary import aggregate
from .distributed import World
from .engine import train_adapter
from .hooks import SilentDisplay
from .job import Job, owned_job, write_report


def train_per_user(recipe: Recipe, run_dir: Path, display, resume: bool = False, force: bool = False) -> dict:
    """One adapter per user (`data.user: all`): users/ID/ holds each user's run, adapters/ID/ its adapter.
    With several ranks, rank r trains users r, r+N, ... on its own; rank 0 then sums up.

    On --resume, finished users are kept, the interrupted one resumes from its checkpoint, the rest start.
    """
    run_dir = Path(run_dir)
    # one tokenizer for every user's load of the same base, and for the evaluations
    with owned_job(recipe, run_dir) as (job, world), shared_tokenizers():
        return _fan_out(recipe, run_dir, display if world.is_main else SilentDisplay(), resume, force, job, world)


def _fan_out(recipe: Recipe, run_dir: Path, display, resume: bool, force: bool, job: Job, world: World) -> dict:
    with rundir.opened_run(run_dir, recipe, resume, force, world, lambda: (user_tasks(recipe), 0), job) as tasks:
        if tasks is None:
            return {"stopped": job.signals.requested, "steps": 0}
        return _train_users(recipe, RunDir(run_dir), display, resume, job, world, tasks)


def _train_users(recipe: Recipe, run: RunDir, display, resume: bool, job: Job, world: World, tasks: dict) -> dict:
    user_ids = list(tasks)
    if recipe.overnight.report and world.is_main and job.state["eval_before"] is None:
        job.state["eval_before"] = _users_eval(recipe, run.eval_before, None)
        job.save()
    for user_id in user_ids[world.rank :: world.size]:
        sub = run.user(user_id)
        if _finished_summary(sub):
            continue
        # the previous user's model sits in reference cycles: free it, and the heap it leaves, before the next loads
        release_freed_memory()
        # each user's summary holds its own peak, not the process's so far
        reset_peak_rss()
        user_display = display.for_user(user_id) if hasattr(display, "for_user") else display
        try:
            user_recipe = replace_key(replace_key(recipe, "data.user", user_id), "overnight.report", False)
            summary = train_adapter(
                user_recipe,
                sub.root,
                user_display,
                resume=resume and sub.holds_run(),
                force=True,
                adapter_dir=run.user_adapter(user_id),
                job=job,
                task=tasks[user_id],
            )
        except Diverged as exc:
            raise Diverged(f"user {user_id} (users/{user_id}): {exc}") from exc
        if summary.get("stopped"):
            break
    world.barrier()
    if not world.is_main:
        return {"rank": world.rank}
    return _per_user_summary(recipe, run, user_ids, display, job)


def _per_user_summary(recipe: Recipe, run: RunDir, user_ids: list[str], display, job: Job) -> dict:
    """Totals over the users' runs on disk; `stopped` while any user's run is unfinished. With overnight.report,
    the held-out metrics before (the base) and after (each user's adapter) go into it and report.json/md."""
    summaries = [json.loads(run.user(u).summary.read_text()) for u in user_ids if run.user(u).summary.is_file()]
    summary = {
        **(aggregate(summaries) if summaries else {"steps": 0}),
        "users": len(summaries),
        "max_steps": recipe.train.max_steps * len(user_ids),
        "run_dir": str(run.root),
    }
    stopped = next((s["stopped"] for s in summaries if s.get("stopped")), None)
    if stopped or len(summaries) < len(user_ids):
        summary["stopped"] = stopped or "not every user trained"
    if recipe.overnight.report and summaries:
        summary["eval_before"] = job.state["eval_before"]
        release_freed_memory()
        summary["eval_after"] = None if summary.get("stopped") else _users_eval(recipe, run.root, run.root)
        write_report(run.root, recipe, job.state, summary, summary["eval_after"], run.adapters, [])
    # the process's peak, the evaluations included (on cuda each user's figure is the device's)
    if summaries and recipe.backend != "cuda":
        summary["peak_mem_mb"] = process_peak_rss_mb()
        if summary["memory"]:
            summary["memory"] = rebased(summary["memory"], summary["peak_mem_mb"])
    write_json_atomic(run.summary, summary)
    display.on_end(summary)
    return summary


def _users_eval(recipe: Recipe, output: Path, run_dir: Path | None) -> dict:
    """Every user's questions, with the base model (no run dir) or each user's adapter; eval.json in `output`."""
    from ..evaluate import run_eval, summary_row

    return summary_row(run_eval(recipe, output, None, run_dir))


def _finished_summary(run: RunDir) -> dict | None:
    summary = json.loads(run.summary.read_text()) if run.summary.is_file() else None
    return None if summary is None or summary.get("stopped") else summary
