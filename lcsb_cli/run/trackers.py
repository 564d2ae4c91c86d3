"""Where the rows of metrics.jsonl go: the file, and the experiment trackers of `train.report_to`.

Each tracker is one small class behind one interface (`Tracker`: `log(row)`, `finish(summary)`, `ids()`), built from
a `TrackerRun` (the run's name, the recipe's name as its project, the resolved recipe as its config, where its store
goes, the ids a previous process of this run recorded), and imported only when a recipe names it. Every tracker gets
every row's numbers under their metrics.jsonl names at the row's step (tensorboard: as train/NAME and eval/NAME), and
the summary at the end (as summary/NAME; a nested section as summary/SECTION/NAME).

Offline by default: wandb runs with mode offline unless WANDB_MODE is set, its files in the run's wandb/; MLflow
writes to a SQLite store in the run dir (mlflow.db, artifacts in mlflow-artifacts/) unless MLFLOW_TRACKING_URI is set;
trackio to its local store, which is the run dir's trackio/ unless TRACKIO_DIR is set (trackio reads TRACKIO_DIR once,
when it is imported: in a process that trains several runs, the first one's). A per-user run's users share the top
run's stores. Each run's trackers.json holds the tracker runs' ids, so that --resume continues the same runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_json_atomic
from ..errors import BadInput
from ..recipe import Recipe, to_dict
from ..rundir import RunDir


class MetricsLog:
    """metrics.jsonl, appended, and the trackers; rows are strict JSON (a NaN or infinity is written as null: the
    row's reason says what it was). Without a path (ranks other than 0) it writes nothing."""

    def __init__(self, path: Path | None = None, trackers: list[Tracker] | None = None):
        # held open for the run; close() closes it
        self.file = open(path, "a") if path is not None else None  # noqa: SIM115
        self.trackers = trackers or []

    def write(self, row: dict) -> None:
        if self.file is not None:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()
        for tracker in self.trackers:
            tracker.log(row)

    def close(self, summary: dict | None = None) -> None:
        """The file closed, each tracker finished with the run's summary (None: the run failed). Once."""
        if self.file is not None:
            self.file.close()
            self.file = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish(summary)


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is given: the run's name, its project (the recipe's name), the resolved recipe, the run's dir,
    the dir its store goes in (the top run's) and what `ids()` returned in an earlier process of this run."""

    name: str
    project: str
    config: dict
    run: RunDir
    store: RunDir
    ids: dict | None


class Tracker:
    def log(self, row: dict) -> None:
        raise NotImplementedError

    def finish(self, summary: dict | None) -> None:
        raise NotImplementedError

    def ids(self) -> dict:
        """What a resumed process needs to continue this tracker's run."""
        return {}


def numbers(row: dict) -> dict[str, float]:
    """A row's finite numbers but its step (metrics.jsonl writes the others as null, strings stay in it)."""
    return {
        key: value
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def failed(summary: dict | None) -> bool:
    """A run that raised (no summary) or diverged; a stopped one is interrupted, to be resumed."""
    return summary is None or bool(summary.get("diverged"))


def flat(data: dict, prefix: str, sep: str = "/") -> dict:
    """Nested sections as PREFIX/SECTION/NAME keys (or joined by `sep`)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}{sep}", sep))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoard(Tracker):
    """The run's tensorboard/: train/NAME and eval/NAME scalars (eval_NAME rows as eval/NAME)."""

    def __init__(self, setup: TrackerRun):
        from torch.utils.tensorboard import SummaryWriter

        self.board = SummaryWriter(str(setup.run.tensorboard), flush_secs=10)

    def log(self, row: dict) -> None:
        for key, value in numbers(row).items():
            tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            self.board.add_scalar(tag, value, row["step"])

    def finish(self, summary: dict | None) -> None:
        self.board.close()


class Wandb(Tracker):
    """A wandb run (offline unless WANDB_MODE says otherwise) with the same id on resume."""

    def __init__(self, setup: TrackerRun):
        import wandb

        known = setup.ids or {}
        self.run = wandb.init(
            project=None if os.environ.get("WANDB_PROJECT") else setup.project,
            name=setup.name,
            id=known.get("id"),
            resume="allow" if known else None,
            dir=str(setup.store.root.resolve()),
            config=setup.config,
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            settings=wandb.Settings(console="off", silent=True, save_code=False),
            reinit="create_new",
        )

    def log(self, row: dict) -> None:
        self.run.log(numbers(row), step=row["step"])

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update(flat(summary, "summary/"))
        self.run.finish(exit_code=1 if failed(summary) else 0)

    def ids(self) -> dict:
        return {"id": self.run.id}


class MLflow(Tracker):
    """An MLflow run in the run dir's SQLite store (or MLFLOW_TRACKING_URI's), continued by its id on resume; the
    recipe as params (dotted keys) and config.json, the summary as summary/NAME metrics and summary.json."""

    def __init__(self, setup: TrackerRun):
        from mlflow import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{setup.store.mlflow_db.resolve()}"
        self.client = MlflowClient(self.uri)
        known = setup.ids or {}
        self.run_id = known.get("run_id") if known.get("tracking_uri") == self.uri else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._create(setup)

    def _create(self, setup: TrackerRun) -> str:
        from mlflow.entities import Param

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or setup.project
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                name, artifact_location=setup.store.mlflow_artifacts.resolve().as_uri() if local else None
            )
        )
        run_id = self.client.create_run(experiment_id, run_name=setup.name).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flat(setup.config, "", ".").items()]
        # MLflow takes at most 100 params a batch
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_dict(run_id, setup.config, "config.json")
        return run_id

    def log(self, row: dict) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(key, float(value), stamp, row["step"]) for key, value in numbers(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.log({"step": summary.get("steps") or 0, **flat(summary, "summary/")})
            self.client.log_dict(self.run_id, summary, "summary.json")
        status = "FAILED" if failed(summary) else "KILLED" if summary.get("stopped") else "FINISHED"
        self.client.set_terminated(self.run_id, status)

    def ids(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}


class Trackio(Tracker):
    """A trackio run in its local store, continued by its name on resume; its prints go to the run's log file."""

    def __init__(self, setup: TrackerRun):
        self.trackio = _import_trackio(setup.store.trackio.resolve())
        known = setup.ids or {}
        with _printed_to_log("trackio"):
            self.run = self.trackio.init(
                project=setup.project,
                name=known.get("name") or setup.name,
                config=setup.config,
                resume="allow" if known else "never",
                auto_log_cpu=False,
                auto_log_gpu=False,
                embed=False,
            )

    def log(self, row: dict) -> None:
        with _printed_to_log("trackio"):
            self.run.log(numbers(row), step=row["step"])

    def finish(self, summary: dict | None) -> None:
        with _printed_to_log("trackio"):
            if summary is not None:
                self.run.log(numbers(flat(summary, "summary/")), step=summary.get("steps") or 0)
            # the module's finish, so its exit hook does not finish the run again
            self.trackio.finish()

    def ids(self) -> dict:
        from trackio import utils

        return {"name": self.run.name, "id": self.run.id, "dir": str(utils.TRACKIO_DIR)}


def _import_trackio(store: Path):
    """trackio, its store in `store` when it is first imported here and TRACKIO_DIR is unset."""
    if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
        os.environ["TRACKIO_DIR"] = str(store)
        try:
            import trackio
        finally:
            del os.environ["TRACKIO_DIR"]
    import trackio

    return trackio


@contextlib.contextmanager
def _printed_to_log(name: str):
    """A library's print()s go to the run's log file, not to the terminal."""
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            yield
    finally:
        for line in text.getvalue().splitlines():
            if line.strip():
                logging.getLogger(name).info(line)


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow, "trackio": Trackio}


def open_trackers(recipe: Recipe, run: RunDir) -> list[Tracker]:
    """The trackers train.report_to names, each continuing the run trackers.json recorded (a resumed run), whose ids
    are then written back at once, so that a run killed later still resumes them."""
    if not recipe.train.report_to:
        return []
    known = json.loads(run.trackers.read_text()) if run.trackers.is_file() else {}
    opened = {}
    for name in recipe.train.report_to:
        setup = TrackerRun(run.run_name(), recipe.name, to_dict(recipe), run, run.top(), known.get(name))
        try:
            opened[name] = TRACKERS[name](setup)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BadInput(f"train.report_to: {name} could not start a run: {first}") from exc
    ids = {**known, **{name: tracker.ids() for name, tracker in opened.items() if tracker.ids()}}
    if ids:
        write_json_atomic(run.trackers, ids)
    return list(opened.values())
