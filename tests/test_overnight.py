"""Overnight job control: the window, time limit, graceful signals, thermal pauses and the morning report."""

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import Quiet, adapter_tensors, assert_same_tensors

from lcsb_cli.backends import CpuBackend, base
from lcsb_cli.errors import BadInput
from lcsb_cli.recipe import load_recipe
from lcsb_cli.recipe.schema import OvernightConfig
from lcsb_cli.run.entry import train
from lcsb_cli.run.job import Job
from lcsb_cli.window import parse_window

REPO = Path(__file__).resolve().parent.parent
OVERNIGHT = REPO / "recipes" / "overnight.yaml"
TINY = ("model.name=tiny-qwen2", "npu_sim.calibration_steps=1", "overnight.report=false", "train.log_every=1")


def at(hour, minute=0, day=1):
    return dt.datetime(2026, 12, day, hour, minute)


def test_window_across_midnight():
    window = parse_window("23:00-02:00")
    assert window.contains(at(23, 30)) and window.contains(at(1, 59)) and window.contains(at(0))
    assert not window.contains(at(2)) and not window.contains(at(12))
    assert window.seconds_until_start(at(22)) == 3600
    assert window.seconds_until_start(at(12)) == 11 * 3600
    assert window.seconds_until_start(at(0, 30)) == 0
    assert window.seconds_until_end(at(23, 30)) == 2.5 * 3600
    assert window.seconds_until_end(at(1, 30)) == 1800
    assert window.seconds_until_end(at(12)) == 0


def test_window_within_a_day_and_bad_windows():
    window = parse_window("01:00-06:00")
    assert window.contains(at(1)) and not window.contains(at(6)) and not window.contains(at(23))
    assert window.seconds_until_start(at(23)) == 2 * 3600
    for text in ("25:00-01:00", "01:00", "1am-6am", "01:00-01:00"):
        with pytest.raises(BadInput, match="overnight.window"):
            parse_window(text)


def test_waiting_for_the_window_sleeps_until_it_opens_and_a_signal_ends_the_wait(tmp_path):
    clock = {"now": at(23, 0)}

    def sleep(seconds):
        clock["now"] += dt.timedelta(seconds=seconds)

    job = Job(OvernightConfig(window="01:00-06:00"), tmp_path, now=lambda: clock["now"], sleep=sleep)
    assert job.wait_for_window() is None and clock["now"] == at(1, 0, day=2)
    assert job.state["waited_s"] == 2 * 3600
    assert job.stop_reason() is None
    clock["now"] = at(6, 0, day=2)
    assert job.stop_reason() == "window_end"

    clock["now"] = at(12)
    job = Job(OvernightConfig(window="01:00-06:00"), tmp_path, now=lambda: clock["now"], sleep=sleep)
    job.signals.requested = "SIGTERM"
    assert job.wait_for_window() == "SIGTERM" and clock["now"] == at(12)


def test_max_minutes_counts_this_process_time(tmp_path):
    ticks = {"t": 0.0}
    job = Job(OvernightConfig(max_minutes=2), tmp_path, clock=lambda: ticks["t"])
    ticks["t"] = 119.0
    assert job.stop_reason() is None
    ticks["t"] = 120.0
    assert job.stop_reason() == "max_minutes"


def test_real_temperature_comes_from_the_hottest_thermal_zone(tmp_path, monkeypatch):
    for zone, millidegrees in (("thermal_zone0", "41000\n"), ("thermal_zone1", "47500\n")):
        (tmp_path / zone).mkdir()
        (tmp_path / zone / "temp").write_text(millidegrees)
    monkeypatch.setattr(base, "THERMAL_ZONES", str(tmp_path / "thermal_zone*" / "temp"))
    assert CpuBackend().temperature() == 47.5
    monkeypatch.setattr(base, "THERMAL_ZONES", str(tmp_path / "none*" / "temp"))
    assert CpuBackend().temperature() is None


def test_a_hot_cpu_pauses_until_it_cools(tmp_path, monkeypatch):
    readings = iter([50.0, 45.0, 41.0, 39.5])
    monkeypatch.setattr(CpuBackend, "temperature", lambda self: next(readings))
    naps = []
    job = Job(OvernightConfig(max_temp_c=42), tmp_path, sleep=naps.append)
    poll = CpuBackend.idle_poll_s
    # to 2 C under
    assert job.cool_down(CpuBackend()) == {"temp_c": 50.0, "paused_s": 3 * poll}
    assert job.state["throttled_s"] == 3 * poll and naps == [poll] * 3


class SignalAt(Quiet):
    """Sends this process SIGTERM after step `step`, as a scheduler would."""

    def __init__(self, step):
        self.step = step

    def on_step(self, row):
        if row.get("step") == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_resume_is_bit_identical(tmp_path):
    recipe = load_recipe(OVERNIGHT, [*TINY, "train.max_steps=8", "train.save_every=0"])
    whole = train(recipe, tmp_path / "whole", Quiet())
    stopped = train(recipe, tmp_path / "split", SignalAt(3))
    assert stopped["stopped"] == "SIGTERM" and stopped["steps"] == 3
    assert (tmp_path / "split" / "checkpoints" / "step-3").is_dir()
    # handlers restored after the run
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    resumed = train(recipe, tmp_path / "split", Quiet(), resume=True)
    assert resumed["steps"] == 8 and "stopped" not in resumed
    assert_same_tensors(adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split"))
    assert resumed["final_loss"] == whole["final_loss"]
    job = json.loads((tmp_path / "split" / "job.json").read_text())
    assert job["resumes"] == 1 and [i["step"] for i in job["interruptions"]] == [3]


@pytest.mark.slow
def test_a_forced_hot_phone_pauses_training_and_it_still_finishes(tmp_path):
    profile = load_recipe(OVERNIGHT).npu_sim.device
    from lcsb_cli.backends.npu_sim.device import load_profile

    hot = load_profile(profile).__dict__ | {
        "skin_heat_capacity_j_per_c": 0.02,
        "soc_heat_capacity_j_per_c": 0.001,
        "cpu_power_w": 40.0,
    }
    (tmp_path / "hot.yaml").write_text("\n".join(f"{k}: {v}" for k, v in hot.items() if k != "name"))
    recipe = load_recipe(
        OVERNIGHT, [*TINY, "train.max_steps=8", f"npu_sim.device={tmp_path / 'hot.yaml'}", "overnight.report=true"]
    )
    summary = train(recipe, tmp_path / "run", Quiet())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    pauses = [r for r in rows if r.get("event") == "throttled"]
    assert summary["steps"] == 8 and pauses and all(r["paused_s"] > 0 for r in pauses)
    assert json.loads((tmp_path / "run" / "job.json").read_text())["throttled_s"] == sum(r["paused_s"] for r in pauses)
    assert recipe.overnight.max_temp_c == 42 == hot["throttle_c"] and len(pauses) >= 2
    # event rows (a throttle) may follow the last step
    assert [r for r in rows if "loss" in r][-1]["step"] == 8
    clock = [r for r in rows if r.get("event", "").startswith("npu_clock")]
    # restored in a pause
    assert [r["event"] for r in clock[:2]] == ["npu_clock_throttled", "npu_clock_restored"]
    assert clock[1]["sim_temp_c"] <= 42 - hot["hysteresis_c"]
    counts = {e: sum(r["event"] == e for r in clock) for e in ("npu_clock_throttled", "npu_clock_restored")}
    assert all(summary["events"][e] == n for e, n in counts.items())
    report = (tmp_path / "run" / "report.md").read_text()
    assert (
        f"heat: {len(pauses)} cool-down pauses; NPU clock throttled {counts['npu_clock_throttled']} times, "
        f"restored {counts['npu_clock_restored']}"
    ) in report


def _lcsb(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "lcsb_cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _signalled(sig, after_steps: int, run, *args):
    """`lcsb train ARGS --output RUN`, sent `sig` once `after_steps` steps are logged: (process, stderr, steps done)."""
    proc = _lcsb("train", *args, "--output", str(run))
    deadline = time.monotonic() + 300
    while _steps_logged(run) < after_steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc, err, json.loads((run / "summary.json").read_text())["steps"]


def _steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_cli_sigterm_exits_0_and_resume_finishes_with_a_morning_report(tmp_path):
    """The shipped recipe as documented: SIGTERM mid-run, then --resume; report.json/md tell the night."""
    run = tmp_path / "night"
    proc, err, stopped_at = _signalled(signal.SIGTERM, 4, run, str(OVERNIGHT), "train.max_steps=12")
    assert proc.returncode == 0, err
    assert 4 <= stopped_at < 12 and (run / "checkpoints" / f"step-{stopped_at}").is_dir()
    # a signal means: exit now
    assert json.loads((run / "report.json").read_text())["eval_after"] is None
    proc = _lcsb("train", str(OVERNIGHT), "train.max_steps=12", "--output", str(run), "--resume")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 12 and report["finished"] and report["resumes"] == 1
    assert [i["reason"] for i in report["interruptions"]] == ["SIGTERM"]
    assert {"accuracy", "macro_f1"} <= report["eval_before"].keys() and report["throttled_s"] == 0
    # the night taught it the user
    assert report["eval_after"]["accuracy"] > report["eval_before"]["accuracy"]
    assert report["adapter"] == str(run / "adapter") and report["lines_skipped"] == 0
    assert "before training" in (run / "report.md").read_text()


@pytest.mark.slow
def test_cli_ctrl_c_checkpoints_and_exits_130(tmp_path):
    run = tmp_path / "run"
    proc, err, stopped_at = _signalled(
        signal.SIGINT, 2, run, str(REPO / "tests" / "tiny.yaml"), "train.max_steps=400", "train.save_every=0"
    )
    assert proc.returncode == 130, err
    assert 2 <= stopped_at < 400 and (run / "checkpoints" / f"step-{stopped_at}").is_dir()
    assert err.strip().splitlines()[-1] == f"interrupted: checkpointed at step {stopped_at}; continue with --resume"


def _sample_with_bad_lines(tmp_path) -> Path:
    lines = (REPO / "recipes" / "data" / "personal" / "messages.jsonl").read_text().splitlines()
    lines[3] = '{"id": "broken", "text": "no label here", "timestamp": 0}'
    lines[7] = "{not json"
    path = tmp_path / "messages.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_bad_jsonl_lines_stop_the_run_or_are_skipped_and_counted(tmp_path):
    data = _sample_with_bad_lines(tmp_path)
    strict = load_recipe(OVERNIGHT, [*TINY, f"data.train={data}", "data.on_bad_line=error", "train.max_steps=2"])
    with pytest.raises(BadInput, match="line 4: .*label"):
        train(strict, tmp_path / "strict", Quiet())
    assert not (tmp_path / "strict").exists()
    lenient = load_recipe(
        OVERNIGHT, [*TINY, f"data.train={data}", "data.on_bad_line=skip", "train.max_steps=2", "overnight.report=true"]
    )
    train(lenient, tmp_path / "lenient", Quiet())
    report = json.loads((tmp_path / "lenient" / "report.json").read_text())
    assert report["lines_skipped"] == 2 and [s["line"] for s in report["skipped"]] == [4, 8]
    assert "data lines skipped: 2" in (tmp_path / "lenient" / "report.md").read_text()
