"""End-to-end training on tiny presets: run directory contract, K=1 == full backprop, exact resume."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import LAMP2, REPO, adapter_tensors, assert_same_tensors, kill_after_step, run_train

from lcsb_cli.errors import BadInput
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import read_metrics
from lcsb_cli.rundir.summary import aggregate, summarize

METRIC_FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_mb",
    "active_block",
    "method",
}
SUMMARY_FIELDS = {
    "method",
    "blocks",
    "steps",
    "final_loss",
    "median_step_time_s",
    "tokens_per_s",
    "peak_mem_mb",
    "wall_time_s",
    "diverged",
    "events",
}


def test_train_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "train.max_steps=6", "train.save_every=4")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(set(r) >= METRIC_FIELDS for r in rows)
    assert [r["active_block"] for r in rows] == [0, 1, 2, 3, 0, 1]
    assert all(r["method"] == "lcsb" and r["tokens"] > 0 and r["peak_mem_mb"] > 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) >= SUMMARY_FIELDS and summary["steps"] == 6 and summary["blocks"] == 4
    parts = summary["memory"]
    assert set(parts) == {
        "peak_rss_mb",
        "runtime_mb",
        "weights_mb",
        "lora_optimizer_mb",
        "activations_mb",
        "logits_mb",
        "other_mb",
    }
    assert parts["peak_rss_mb"] == pytest.approx(sum(v for k, v in parts.items() if k != "peak_rss_mb"), abs=1)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["max_steps"] == 6 and config["lcsb"]["blocks"] == 4
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-6"]


def test_summary_and_per_user_totals_from_hand_made_rows():
    rows = [
        {
            "step": 1,
            "loss": 3.0,
            "tokens": 100,
            "step_time_s": 1.0,
            "peak_mem_mb": 50.0,
            "forward_s": 0.3,
            "backward_s": 0.6,
        },
        {
            "step": 2,
            "loss": 2.0,
            "tokens": 100,
            "step_time_s": 3.0,
            "peak_mem_mb": 70.0,
            "forward_s": 0.5,
            "backward_s": 2.0,
            "event": "rollback",
        },
        # an event row: no step statistics
        {"step": 2, "event": "throttled"},
        {
            "step": 3,
            "loss": 1.5,
            "tokens": 200,
            "step_time_s": 2.0,
            "peak_mem_mb": 60.0,
            "forward_s": 0.4,
            "backward_s": 1.0,
        },
    ]
    method = type("Method", (), {"name": "lcsb", "blocks": 4})()
    summary = summarize(rows, method, wall_time_s=7.0)
    assert summary["steps"] == 3 and summary["final_loss"] == 1.5 and summary["median_step_time_s"] == 2.0
    assert summary["tokens_per_s"] == 400 / 6.0 and summary["peak_mem_mb"] == 70.0
    assert (summary["median_forward_s"], summary["median_backward_s"]) == (0.4, 1.0)
    assert summary["events"] == {"rollback": 1, "throttled": 1} and "sim_energy_j" not in summary
    other = {
        **summary,
        "steps": 1,
        "final_loss": 0.5,
        "median_step_time_s": 4.0,
        "tokens_per_s": 50.0,
        "peak_mem_mb": 90.0,
        "wall_time_s": 3.0,
        "events": {"rollback": 2},
        "memory": None,
    }
    pooled = aggregate([{**summary, "memory": None}, other])
    assert pooled["steps"] == 4 and pooled["final_loss"] == 1.0 and pooled["median_step_time_s"] == 3.0
    assert pooled["peak_mem_mb"] == 90.0 and pooled["wall_time_s"] == 10.0
    assert pooled["events"] == {"rollback": 3, "throttled": 1}


@pytest.mark.parametrize(
    "path",
    [
        ("lcsb.upper_path=identity",),
        ("lcsb.experimental.exact_above=2",),
        ("lcsb.upper_path=suffix",),
        ("lcsb.experimental.lr_scale=sqrt_k", "lcsb.experimental.switch_every=3", "lcsb.experimental.on_return=reset"),
    ],
)
def test_k1_reproduces_full_backprop_bit_for_bit(tmp_path, path):
    lcsb = run_train(tmp_path / "k1", "train.max_steps=4", "lcsb.blocks=1", *path)
    full = run_train(tmp_path / "full", "train.max_steps=4", "method=full-backprop")
    losses = [[r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")] for name in ("k1", "full")]
    assert losses[0] == losses[1]
    assert lcsb["final_loss"] == full["final_loss"]
    assert_same_tensors(adapter_tensors(tmp_path / "k1"), adapter_tensors(tmp_path / "full"))


def test_padding_to_a_multiple_trains_as_padding_to_the_longest_row(tmp_path):
    """Pads are masked out of attention and loss, so data.pad_to_multiple_of changes only the matmul shapes: fp32
    losses and the trained adapter agree to rounding."""
    fixed = ("data.user=null", "train.max_steps=4", "train.autocast=none")
    runs = {m: tmp_path / f"pad{m}" for m in (1, 32)}
    for multiple, run_dir in runs.items():
        run_train(run_dir, *fixed, f"data.pad_to_multiple_of={multiple}")
    losses = [[r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")] for run_dir in runs.values()]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = (adapter_tensors(run_dir) for run_dir in runs.values())
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert [r["tokens"] for r in read_metrics(runs[1] / "metrics.jsonl")] == [
        r["tokens"] for r in read_metrics(runs[32] / "metrics.jsonl")
    ]


def test_lcsb_differs_from_full_backprop(tmp_path):
    run_train(tmp_path / "k4", "train.max_steps=3")
    run_train(tmp_path / "full", "train.max_steps=3", "method=full-backprop")
    a, b = adapter_tensors(tmp_path / "k4"), adapter_tensors(tmp_path / "full")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _start(run_dir, *extra):
    cmd = [
        sys.executable,
        "-m",
        "lcsb_cli",
        "train",
        str(LAMP2),
        "--output",
        str(run_dir),
        "train.max_steps=20",
        "train.save_every=3",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


DATA = REPO / "recipes" / "data"
NO_LABELS = ("data.eval=null", "data.train_labels=null", "data.eval_labels=null")
FORMATS = {
    "lamp2": (),
    "text": ("data.format=text", f"data.train={DATA / 'text' / 'train.txt'}", "data.max_length=64", *NO_LABELS),
    "chat": ("data.format=chat", f"data.train={DATA / 'chat' / 'train.jsonl'}", "data.max_length=96", *NO_LABELS),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, data, window",
    [("cyclic", "lamp2", 0), ("random", "lamp2", 2), ("cyclic", "text", 0), ("cyclic", "chat", 0)],
)
def test_sigkill_then_resume_is_bit_identical(tmp_path, schedule, data, window):
    overrides = (
        f"lcsb.experimental.schedule={schedule}",
        f"lcsb.experimental.exact_above={window}",
        "lora.dropout=0.1",
        *FORMATS[data],
    )
    reference = tmp_path / "reference"
    run_train(reference, "train.max_steps=20", "train.save_every=3", *overrides)

    killed = tmp_path / "killed"
    # 15 steps short of the end: far from finishing, even on a fast machine
    kill_after_step(_start(killed, *overrides), killed, 5, timeout=120)

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lcsb_cli",
            "train",
            str(LAMP2),
            "--output",
            str(killed),
            "--resume",
            "train.max_steps=20",
            "train.save_every=3",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tensors(adapter_tensors(killed), adapter_tensors(reference))
    rows, ref_rows = read_metrics(killed / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    assert [r["active_block"] for r in rows] == [r["active_block"] for r in ref_rows]


@pytest.mark.slow
def test_report_to_tensorboard_writes_every_metrics_row_that_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_train(run_dir, "train.max_steps=3", "train.eval_every=3", "train.report_to=[tensorboard]")
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [(s, pytest.approx(v)) for s, v in losses]
    (eval_row,) = [r for r in rows if "eval_loss" in r]
    assert [(e.step, e.value) for e in board.Scalars("eval/loss")] == [(3, pytest.approx(eval_row["eval_loss"]))]
    assert "train/lr" in board.Tags()["scalars"]
    with pytest.raises(BadInput, match="train.report_to: 'comet' is not a known tracker"):
        load_recipe(LAMP2, ["train.report_to=[comet]"])


@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine"])
def test_every_scheduler_warms_up_linearly_from_zero(tmp_path, scheduler):
    run_train(tmp_path, "train.max_steps=4", "train.warmup_steps=2", f"train.lr_scheduler={scheduler}")
    rates = [row["lr"] for row in read_metrics(tmp_path / "metrics.jsonl")]
    assert rates[:3] == [0.0, 5e-4, 1e-3]
    assert scheduler != "constant" or rates[3] == 1e-3


def test_loss_only_eval_rows_keep_the_full_metrics_for_the_last_row(tmp_path):
    both = {}
    for kind in ("all", "loss"):
        run_train(tmp_path / kind, "train.max_steps=4", "train.eval_every=2", f"train.eval_metrics={kind}")
        both[kind] = [r for r in read_metrics(tmp_path / kind / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in both["loss"]] == [2, 4]
    assert "eval_accuracy" not in both["loss"][0] and "eval_accuracy" in both["loss"][1]
    loss_row, all_row = both["loss"][0], both["all"][0]
    assert loss_row == {key: all_row[key] for key in loss_row}
    assert both["loss"][1] == both["all"][1]
