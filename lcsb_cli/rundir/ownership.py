"""Who owns a run directory and when: a fresh run or a resume is checked, set up, then claims the dir under its
writer lock; what a resume may change."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import yaml

from ..atomic import write_text_atomic
from ..errors import BadInput
from ..recipe import Recipe, dump, recipe_from_dict, to_dict
from ..runtime import log_to
from .checkpoint import checkpoint_dirs
from .layout import RunDir
from .metrics import truncate_metrics

# Keys a resumed run may change: they alter how long it runs or how it reports, never the math of a step.
RESUMABLE_CHANGES = {
    "train.max_steps",
    "train.log_every",
    "train.save_every",
    "train.threads",
    "train.report_to",
    "output_dir",
}


def check_fresh(run_dir: Path, force: bool) -> None:
    """A new run may not take over a dir holding another run unless `force`."""
    check_output_dir(run_dir)
    if RunDir(run_dir).holds_run() and not force:
        raise BadInput(f"{run_dir} already holds a run; pass --resume to continue it or --force to replace it")


def check_output_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise BadInput(f"--output: {path} is a file, not a directory; choose a directory")


def prepare_fresh(run: RunDir, recipe: Recipe) -> None:
    """Clear an old run's files (checked by check_fresh) and write the resolved recipe."""
    for path in run.run_paths():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    run.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run.config, dump(recipe))


def check_resume(run_dir: Path, recipe: Recipe) -> None:
    """A resume needs a run with a checkpoint (for a per-user run: a user's run) made by the same recipe,
    up to RESUMABLE_CHANGES."""
    run = RunDir(run_dir)
    per_user = recipe.data.user == "all"
    started = (
        any(RunDir(d).holds_run() for d in (run.root / "users").glob("*"))
        if per_user
        else checkpoint_dirs(run.checkpoints)
    )
    if not started or not run.is_run():
        raise BadInput(f"{run_dir}: no checkpoint to resume from (start a fresh run without --resume)")
    saved = yaml.safe_load(run.config.read_text())
    for key in _differing_keys(to_dict(recipe_from_dict(saved or {})), to_dict(recipe)):
        if key not in RESUMABLE_CHANGES:
            raise BadInput(
                f"--resume: {key} differs from the run's config.yaml; only "
                f"{', '.join(sorted(RESUMABLE_CHANGES))} may change on resume"
            )


def claim(run_dir: Path, recipe: Recipe, resume: bool, resumed_step: int) -> None:
    """Take the checked run dir (its writer lock is held): a fresh run clears an old run's files (allowed by
    --force); both write the resolved recipe; a resumed run drops metrics rows logged after its checkpoint. From
    here on the libraries' log records (those of the set-up too) go to the run's log file."""
    run = RunDir(run_dir)
    if resume:
        write_text_atomic(run.config, dump(recipe))
        if resumed_step:
            truncate_metrics(run.metrics, resumed_step)
    else:
        prepare_fresh(run, recipe)
    log_to(run.log)


def _differing_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [k for key in keys for k in _differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


@contextlib.contextmanager
def opened_run(run_dir: Path, recipe: Recipe, resume: bool, force: bool, world, setup, job=None):
    """The preamble of every run: check the dir (a resume, or a fresh run, with no other process writing it),
    wait for the overnight window when this run owns its `job`, set up (`setup()` returns a value and the step
    the run starts at), then take the writer lock, claim the dir and load the job's totals. Nothing in run_dir
    changes before the claim. Yields setup's value, or None when a signal ended the wait; the lock is held
    until the caller's block ends."""
    check_resume(run_dir, recipe) if resume else check_fresh(run_dir, force)
    RunDir(run_dir).check_no_writer()
    if job is not None and job.wait_for_window():
        yield None
        return
    value, first_step = setup()
    # every rank has checked the run dir before rank 0 writes into it
    world.barrier()
    with RunDir(run_dir).writer() if world.is_main else contextlib.nullcontext():
        if world.is_main:
            claim(run_dir, recipe, resume, first_step)
        world.barrier()
        if not RunDir(run_dir).config.is_file():
            raise BadInput(
                f"{run_dir}: rank {world.rank} does not see the run dir rank 0 wrote; across nodes the output dir "
                "must be one directory every node shares, at the same path"
            )
        if job is not None:
            job.load(resume)
        yield value
