"""The run directory: who owns it, what a resume may change, and the metrics log."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from ..atomic import write_text_atomic
from ..errors import BadInput
from ..recipe import Recipe, dump, recipe_from_dict, to_dict
from ..runtime import LOG_FILE, log_to
from .checkpoint import checkpoint_dirs

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "adapter", "checkpoints", "users", "adapters",
             "eval.json", "predictions.json", LOG_FILE)
# Keys a resumed run may change: they alter how long it runs or how it reports, never the math of a step.
RESUMABLE_CHANGES = {"train.max_steps", "train.log_every", "train.save_every", "train.threads", "output_dir"}


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def check_fresh(run_dir: Path, force: bool) -> None:
    """A new run may not take over a dir holding another run unless `force`."""
    check_output_dir(run_dir)
    if holds_run(run_dir) and not force:
        raise BadInput(f"{run_dir} already holds a run; pass --resume to continue it or --force to replace it")


def check_output_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise BadInput(f"--output: {path} is a file, not a directory; choose a directory")


def prepare_fresh(run_dir: Path, recipe: Recipe) -> None:
    """Clear an old run's files (checked by check_fresh) and write the resolved recipe."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", dump(recipe))


def check_resume(run_dir: Path, recipe: Recipe) -> None:
    """A resume needs a run with a checkpoint (for a per-user run: a user's run) made by the same recipe,
    up to RESUMABLE_CHANGES."""
    per_user = recipe.data.user == "all"
    started = any(holds_run(d) for d in (run_dir / "users").glob("*")) if per_user else checkpoint_dirs(run_dir)
    if not started or not (run_dir / "config.yaml").is_file():
        raise BadInput(f"{run_dir}: no checkpoint to resume from (start a fresh run without --resume)")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    for key in _differing_keys(to_dict(recipe_from_dict(saved or {})), to_dict(recipe)):
        if key not in RESUMABLE_CHANGES:
            raise BadInput(f"--resume: {key} differs from the run's config.yaml; only "
                           f"{', '.join(sorted(RESUMABLE_CHANGES))} may change on resume")



def claim(run_dir: Path, recipe: Recipe, resume: bool, resumed_step: int) -> None:
    """Take the checked run dir: a fresh run clears an old run's files (allowed by --force); both write the
    resolved recipe; a resumed run drops metrics rows logged after its checkpoint. From here on the libraries'
    log records (those of the set-up too) go to the run's log file."""
    if resume:
        write_text_atomic(run_dir / "config.yaml", dump(recipe))
        if resumed_step:
            truncate_metrics(run_dir / "metrics.jsonl", resumed_step)
    else:
        prepare_fresh(run_dir, recipe)
    log_to(run_dir / LOG_FILE)


def truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep the complete rows up to `last_step` (a killed run may have logged past its last checkpoint)."""
    rows = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return rows


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return rows


def _differing_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [k for key in keys for k in _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def open_run(run_dir: Path, recipe: Recipe, resume: bool, force: bool, world, setup, job=None):
    """The preamble of every run: check the dir (a resume, or a fresh run), wait for the overnight window when
    this run owns its `job`, set up (`setup()` returns a value and the step the run starts at), then claim the
    dir and load the job's totals. Nothing in run_dir changes before the claim. Returns setup's value, or None
    when a signal ended the wait."""
    check_resume(run_dir, recipe) if resume else check_fresh(run_dir, force)
    if job is not None and job.wait_for_window():
        return None
    value, first_step = setup()
    world.barrier()  # every rank has checked the run dir before rank 0 writes into it
    if world.is_main:
        claim(run_dir, recipe, resume, first_step)
    world.barrier()
    if job is not None:
        job.load(resume)
    return value
