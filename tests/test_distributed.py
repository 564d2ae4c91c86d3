"""Data parallel on torch.distributed (gloo, 2 CPU processes via `lcsb train --nproc 2`)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, assert_same_tensors, cli

# two ranks, each a fresh interpreter
pytestmark = pytest.mark.slow
COMMON = ("train.max_steps=4", "train.save_every=2", "train.log_every=1", "train.lr_scheduler=constant")


def lcsb(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lcsb_cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line] or proc.stderr[-1000:].splitlines()


def steps(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def lora_bytes_per_layer(run_dir):
    tensors = adapter_tensors(run_dir)
    return sum(t.numel() * 4 for k, t in tensors.items() if ".layers.0." in k), sum(".layers.0." in k for k in tensors)


def test_two_ranks_equal_one_process_with_the_global_batch_and_send_only_the_active_block(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    proc = lcsb("train", str(LAMP2), *COMMON, "train.batch_size=2", "--nproc", "2", "--output", str(two))
    assert proc.returncode == 0, errors(proc)
    assert cli("train", str(LAMP2), *COMMON, "train.batch_size=4", "--output", str(one)).returncode == 0
    a, b = adapter_tensors(one), adapter_tensors(two)
    assert a.keys() == b.keys()
    for key in a:
        # fp32 reduction order only; AdamW turns a 1e-7 gradient difference into up to ~lr * 1e-2 on a weight
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=2e-5)
    for single, data_parallel in zip(steps(one), steps(two)):
        assert abs(single["loss"] - data_parallel["loss"]) < 1e-5 and single["tokens"] == data_parallel["tokens"]
    # tiny-qwen2 with K=4: one layer a block
    block_bytes, block_tensors = lora_bytes_per_layer(one)
    assert [(r["comm_tensors"], r["comm_bytes"]) for r in steps(two)] == [(block_tensors, block_bytes)] * 4
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert not (two / "checkpoints" / "step-4" / "rank-1").exists() and len(list(two.glob("adapter*"))) == 1

    # the N=2 run as it was at its step-2 checkpoint
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    refused = cli("train", str(LAMP2), *COMMON, "train.batch_size=2", "--output", str(resumed), "--resume")
    assert refused.returncode == 2 and "resume with --nproc 2" in refused.stderr
    proc = lcsb(
        "train", str(LAMP2), *COMMON, "train.batch_size=2", "--nproc", "2", "--output", str(resumed), "--resume"
    )
    assert proc.returncode == 0, errors(proc)
    assert_same_tensors(adapter_tensors(two), adapter_tensors(resumed))
    assert [r["loss"] for r in steps(two)] == [r["loss"] for r in steps(resumed)]


def _five_users(tmp_path):
    """The sample's questions and golds of its first five users."""
    data = REPO / "recipes" / "data" / "lamp2"
    questions = json.loads((data / "dev_questions.json").read_text())
    keep = sorted({q["user_id"] for q in questions})[:5]
    questions = [q for q in questions if q["user_id"] in keep]
    ids = {q["id"] for q in questions}
    golds = json.loads((data / "dev_outputs.json").read_text())
    golds["golds"] = [g for g in golds["golds"] if g["id"] in ids]
    (tmp_path / "q.json").write_text(json.dumps(questions))
    (tmp_path / "o.json").write_text(json.dumps(golds))
    return keep, (f"data.eval={tmp_path / 'q.json'}", f"data.eval_labels={tmp_path / 'o.json'}")


def test_per_user_runs_are_split_across_ranks(tmp_path):
    keep, data = _five_users(tmp_path)
    run = tmp_path / "users"
    proc = lcsb(
        "train",
        str(LAMP2),
        *data,
        "data.user=all",
        "train.max_steps=2",
        "train.save_every=0",
        "--nproc",
        "2",
        "--output",
        str(run),
    )
    assert proc.returncode == 0, errors(proc)
    assert sorted(p.name for p in (run / "users").iterdir()) == keep
    assert sorted(p.name for p in (run / "adapters").iterdir()) == keep
    summary = json.loads((run / "summary.json").read_text())
    assert summary["users"] == 5 and summary["steps"] == 10 and "stopped" not in summary
