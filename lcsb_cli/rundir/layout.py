"""A run directory's layout (RunDir, the one place that knows it) and its writer lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..runtime import LOG_FILE

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
