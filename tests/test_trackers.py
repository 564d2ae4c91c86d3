"""train.report_to: wandb, mlflow and trackio (with the real packages, offline) get the resolved recipe, every
metrics.jsonl row under its own names, the summary and the run dir's name; values read back from each tracker's own
store equal metrics.jsonl, and --resume continues the same tracker runs."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import LAMP2, REPO, assert_one_line_error, cli, run_train

from lcsb_cli.rundir import read_metrics

TRACKED = (
    "train.max_steps=4",
    "train.eval_every=2",
    "train.eval_metrics=loss",
    "train.report_to=[wandb,mlflow,trackio]",
)
PROJECT = "lamp2-tiny-test"


def expected_points(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, name) -> value of every number of every metrics.jsonl row."""
    points = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                points[row["step"], key] = value
    assert len(points) > 30
    return points


def wandb_records(run_dir: Path) -> list:
    """The records of every offline wandb run file under the run dir, in order (the LevelDB-style log wandb writes:
    a 7-byte file header, then per 32 KiB block records of crc32, length, type and a protobuf chunk)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
            buf += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                records.append(pb.Record.FromString(buf))
                buf = b""
    return records


def wandb_points(records: list) -> dict[tuple[int, str], float]:
    points = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    points[step, key] = json.loads(item.value_json)
    return points


def wandb_summary(records: list) -> dict:
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update})
    return {key: json.loads(value) for key, value in summary.items()}


def mlflow_run(run_dir: Path):
    from mlflow import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    client = MlflowClient(ids["tracking_uri"])
    return client, client.get_run(ids["run_id"])


def mlflow_points(client, run) -> dict[tuple[int, str], float]:
    return {
        (m.step, key): m.value
        for key in run.data.metrics
        if not key.startswith("summary/")
        for m in client.get_metric_history(run.info.run_id, key)
    }


TRACKIO_READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project, name = sys.argv[1:]
print(json.dumps({"logs": SQLiteStorage.get_logs(project, name), "runs": SQLiteStorage.get_runs(project),
                  "config": SQLiteStorage.get_run_config(project, name)}))
"""


def trackio_store(run_dir: Path) -> dict:
    """trackio's own reader over the store trackers.json names (trackio reads TRACKIO_DIR when imported: a fresh
    interpreter, so the store is the one asked for whatever this test process imported before)."""
    ids = json.loads((run_dir / "trackers.json").read_text())["trackio"]
    proc = subprocess.run(
        [sys.executable, "-c", TRACKIO_READ, PROJECT, ids["name"]],
        env={**os.environ, "TRACKIO_DIR": ids["dir"], "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def trackio_points(logs: list[dict]) -> dict[tuple[int, str], float]:
    return {
        (row["step"], key): value
        for row in logs
        for key, value in row.items()
        if key not in ("step", "timestamp") and not key.startswith("summary/")
    }


def without_network() -> list[str]:
    """`unshare -rn` (a network namespace with no interface up) where the kernel lets this user make one."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-rn"]
    return []


@pytest.mark.slow
def test_every_tracker_holds_the_recipe_every_row_and_the_summary_offline(tmp_path):
    """The CLI, without HF_HUB_OFFLINE, and where the kernel allows it with no network at all."""
    run_dir = tmp_path / "tracked"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "WANDB_MODE", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(
        [*without_network(), sys.executable, "-m", "lcsb_cli", "train", str(LAMP2), "-o", str(run_dir), *TRACKED],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    # the trackers' own prints go to the run's log, not the terminal
    assert "rackio" not in proc.stdout + proc.stderr and "wandb" not in proc.stdout + proc.stderr
    expected = expected_points(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())

    records = wandb_records(run_dir)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.display_name == "tracked" and started.project == PROJECT
    assert {i.key: json.loads(i.value_json) for i in started.config.update if i.key != "_wandb"} == config
    assert wandb_points(records) == expected
    assert wandb_summary(records)["summary/final_loss"] == summary["final_loss"]

    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(config["train"]["lr"])
    assert run.data.params["lora.targets"] == str(config["lora"]["targets"])
    assert mlflow_points(client, run) == expected
    assert run.data.metrics["summary/final_loss"] == summary["final_loss"]

    store = trackio_store(run_dir)
    assert json.loads((run_dir / "trackers.json").read_text())["trackio"]["dir"] == str(run_dir / "trackio")
    assert [r["name"] if isinstance(r, dict) else r for r in store["runs"]] == ["tracked"]
    assert trackio_points(store["logs"]) == expected
    assert {k: v for k, v in store["config"].items() if not k.startswith("_")} == config
    (last,) = [row for row in store["logs"] if "summary/final_loss" in row]
    assert last["summary/final_loss"] == summary["final_loss"]


@pytest.mark.slow
def test_resume_continues_the_same_tracker_runs(tmp_path):
    run_dir = tmp_path / "resumed"
    run_train(run_dir, *TRACKED, "train.max_steps=2", "train.save_every=2")
    first = json.loads((run_dir / "trackers.json").read_text())
    run_train(run_dir, *TRACKED, resume=True)
    assert json.loads((run_dir / "trackers.json").read_text()) == first
    expected = expected_points(run_dir)
    assert {step for step, _ in expected} == {1, 2, 3, 4}

    records = wandb_records(run_dir)
    # offline, each process writes its own file of the same run id (wandb sync joins them)
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {first["wandb"]["id"]}
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2
    assert wandb_points(records) == expected

    client, run = mlflow_run(run_dir)
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert mlflow_points(client, run) == expected and run.info.status == "FINISHED"

    store = trackio_store(run_dir)
    assert store["runs"] == ["resumed"] or [r["name"] for r in store["runs"]] == ["resumed"]
    assert trackio_points(store["logs"]) == expected


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_a_tracker_not_installed_names_its_extra(monkeypatch, tracker):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    proc = cli("validate", str(LAMP2), f"train.report_to=[{tracker}]")
    assert_one_line_error(proc, "train.report_to", f"pip install 'lcsb[{tracker}]'")


def test_unknown_and_repeated_trackers_are_bad_input():
    from lcsb_cli.recipe import TRACKER_MODULES
    from lcsb_cli.run.trackers import TRACKERS

    # what validation accepts is what the run can open
    assert list(TRACKERS) == list(TRACKER_MODULES)
    assert_one_line_error(cli("validate", str(LAMP2), "train.report_to=[comet]"), "'comet'", "wandb, mlflow, trackio")
    assert_one_line_error(cli("validate", str(LAMP2), "train.report_to=[wandb,wandb]"), "named twice")


def test_trackers_load_only_when_named():
    """A run's modules up to its trackers (recipe, engine, hooks) import no tracker package."""
    code = (
        "import sys; from lcsb_cli.recipe import load_recipe; import lcsb_cli.run.engine, lcsb_cli.run.trackers; "
        f"load_recipe({str(LAMP2)!r}); "
        "print(sorted(m for m in ('wandb', 'mlflow', 'trackio', 'tensorboard') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
