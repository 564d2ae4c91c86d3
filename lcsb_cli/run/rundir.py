"""The run directory: its layout (RunDir, the one place that knows it), who owns it and who writes it, what a
resume may change, and the metrics log."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..atomic import write_text_atomic
from ..errors import BadInput
from ..paths import recipe_file
from ..recipe import Recipe, dump, load_recipe, recipe_from_dict, replace_key, to_dict
from ..runtime import LOG_FILE, log_to
from .checkpoint import checkpoint_dirs

# Keys a resumed run may change: they alter how long it runs or how it reports, never the math of a step.
RESUMABLE_CHANGES = {
    "train.max_steps",
    "train.log_every",
    "train.save_every",
    "train.threads",
    "train.report_to",
    "output_dir",
}


# the run dirs whose lock this process holds
_HELD: set[Path] = set()


@dataclass(frozen=True)
class RunDir:
    """Every path of a run directory and the lookups on it. A per-user run keeps each user's run in users/ID/ (a
    RunDir of its own) and each user's adapter in adapters/ID/. With train.keep_best, adapter/ (adapters/ID/) is the
    best adapter and adapter-last/ (users/ID/adapter-last/) the last. Trackers (train.report_to) keep their stores in
    the top run's dir (wandb/, mlflow.db + mlflow-artifacts/, trackio/) and their run ids in each run's
    trackers.json."""

    root: Path

    FILES = (
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "adapter",
        "adapter-last",
        "checkpoints",
        "users",
        "adapters",
        "eval.json",
        "predictions.json",
        "job.json",
        "report.md",
        "report.json",
        "snapshot",
        "tensorboard",
        "trackers.json",
        "wandb",
        "mlflow.db",
        "mlflow-artifacts",
        "trackio",
        "eval-before",
        LOG_FILE,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    summary = property(lambda self: self.root / "summary.json")
    adapter = property(lambda self: self.root / "adapter")
    adapter_last = property(lambda self: self.root / "adapter-last")
    checkpoints = property(lambda self: self.root / "checkpoints")
    job = property(lambda self: self.root / "job.json")
    report_md = property(lambda self: self.root / "report.md")
    report_json = property(lambda self: self.root / "report.json")
    tensorboard = property(lambda self: self.root / "tensorboard")
    trackers = property(lambda self: self.root / "trackers.json")
    wandb = property(lambda self: self.root / "wandb")
    mlflow_db = property(lambda self: self.root / "mlflow.db")
    mlflow_artifacts = property(lambda self: self.root / "mlflow-artifacts")
    trackio = property(lambda self: self.root / "trackio")
    eval_json = property(lambda self: self.root / "eval.json")
    predictions = property(lambda self: self.root / "predictions.json")
    eval_before = property(lambda self: self.root / "eval-before")
    adapters = property(lambda self: self.root / "adapters")
    log = property(lambda self: self.root / LOG_FILE)
    lock = property(lambda self: self.root / "lcsb.lock")

    def user(self, user_id: str) -> RunDir:
        return RunDir(self.root / "users" / user_id)

    def user_adapter(self, user_id: str) -> Path:
        return self.adapters / user_id

    def top(self) -> RunDir:
        """The run this one belongs to: a user's run (users/ID of a per-user run) belongs to the per-user run."""
        up = self.root.resolve().parent
        return RunDir(up.parent) if up.name == "users" and RunDir(up.parent).is_run() else self

    def run_name(self) -> str:
        """The run dir's name, as trackers name the run; a user's run: the per-user run's name and the user id."""
        top, own = self.top(), self.root.resolve().name
        return own if top is self else f"{top.root.resolve().name}-{own}"

    def snapshot(self, rank: int) -> Path:
        """Each data-parallel rank keeps its own divergence snapshot."""
        return self.root / ("snapshot" if rank == 0 else f"snapshot-rank{rank}")

    def is_run(self) -> bool:
        return self.config.is_file()

    def holds_run(self) -> bool:
        return bool(self.run_paths())

    def run_paths(self) -> list[Path]:
        return [
            p for p in [*(self.root / name for name in self.FILES), *self.root.glob("snapshot-rank*")] if p.exists()
        ]

    def adapter_of(self, user: str | None, per_user: bool) -> Path | None:
        """The run's adapter/, or adapters/USER/; None for a per-user run when no user is named."""
        if user is not None:
            adapter = self.user_adapter(user)
            if not (adapter / "adapter_config.json").is_file():
                raise BadInput(f"--user: {self.root} has no adapter for user {user!r} (no {adapter})")
            return adapter
        if per_user:
            return None
        if not self.adapter.is_dir():
            raise BadInput(f"{self.root}: the run has no adapter/ yet; finish it with `lcsb train ... --resume`")
        return self.adapter

    def check_no_writer(self) -> None:
        """Refuse early (before minutes of set-up) when another process is writing this run; reads, never writes."""
        if self.lock.is_file() and self.root.resolve() not in _HELD:
            fd = os.open(self.lock, os.O_RDONLY)
            try:
                self._try_lock(fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def writer(self):
        """Hold the run's exclusive lock (lcsb.lock, with the holder's process id) while this process writes it;
        re-entered by the holder (an evaluation inside its training run). The kernel drops the lock when its
        process dies, so a killed run never blocks the next --resume."""
        key = self.root.resolve()
        if key in _HELD:
            yield self
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._try_lock(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _HELD.add(key)
            yield self
        finally:
            _HELD.discard(key)
            # closing the descriptor releases the lock
            os.close(fd)

    def _try_lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise BadInput(
                f"{self.root}: process {holder} is writing this run ({self.lock.name}); wait for it to end or stop it"
            ) from None


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
            # a line cut short by a kill
            except json.JSONDecodeError:
                continue
    return rows


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


def resolve_target(
    target: str, overrides: list[str], adapter: Path | None, user: str | None = None, model_dir_ok: bool = False
) -> tuple[Recipe, Path | None, Path | None]:
    """(recipe, adapter, run dir) of eval's and generate's TARGET: a recipe file or shipped name (the base model, or
    --adapter); a run dir (its config.yaml and adapter/, or adapters/USER/; a per-user run without --user: no
    adapter); with model_dir_ok, a merged export (an HF dir without config.yaml: the default recipe on it)."""
    path = Path(target)
    if adapter is not None and user is not None:
        raise BadInput("--adapter and --user both name an adapter; give one")
    if not path.is_dir():
        if not path.exists() and not recipe_file(target).is_file():
            raise BadInput(f"{target}: not found; give a recipe file, a shipped recipe (`lcsb recipes`) or a run dir")
        if user is not None:
            raise BadInput("--user: picks a user's adapter in a per-user run dir; give the run dir")
        return load_recipe(recipe_file(target), overrides), adapter, None
    run = RunDir(path)
    if run.is_run():
        recipe = load_recipe(run.config, overrides)
        return recipe, adapter or run.adapter_of(user, recipe.data.user == "all"), path
    if model_dir_ok and (path / "config.json").is_file():
        return _model_dir_recipe(path, overrides), adapter, None
    merged = " or a merged model dir (config.json)" if model_dir_ok else ""
    raise BadInput(f"{path}: not a run directory (no config.yaml); give a recipe, a run dir{merged}")


def _model_dir_recipe(model_dir: Path, overrides: list[str]) -> Recipe:
    """A merged export carries no recipe: the defaults, with model.name pointing at it."""
    if overrides:
        raise BadInput(
            f"{model_dir}: a model dir takes no KEY=VALUE overrides; give a recipe and "
            f"model.name={model_dir} with them instead"
        )
    return replace_key(Recipe(name=model_dir.name), "model.name", str(model_dir.resolve()))


def finished_run(run_dir: Path, user: str | None) -> tuple[Recipe, Path]:
    """(recipe, adapter) of a run dir that export reads: its config.yaml and adapter/ or adapters/USER/."""
    run = RunDir(run_dir)
    if not run.is_run():
        raise BadInput(f"{run_dir}: not a run directory (no config.yaml)")
    adapter = run.user_adapter(user) if user else run.adapter
    if not (adapter / "adapter_config.json").is_file():
        hint = " (a per-user run: pass --user ID)" if run.adapters.is_dir() and not user else ""
        raise BadInput(f"{adapter}: no adapter to export{hint}; finish the run first")
    return load_recipe(run.config), adapter
