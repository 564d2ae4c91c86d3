"""train.keep_best and train.early_stopping_patience: adapter/ holds the adapter of the lowest held-out loss and
adapter-last/ the last, the run stops after N evaluations without an improvement, summary.json says both, per-user
runs decide per user, and a run killed with SIGKILL resumes to the same adapters bit for bit."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    LAMP2,
    REPO,
    adapter_tensors,
    assert_one_line_error,
    assert_same_tensors,
    cli,
    kill_after_step,
    run_train,
)
from safetensors.torch import load_file

from lcsb_cli.run.best import BestWatch
from lcsb_cli.rundir import read_metrics

# constant rate 2e-2 on the tiny recipe: held-out loss falls to step 6, rises at 8 and 10, falls at 12 but not below
# step 6's; with patience 3 the run stops at step 12 and step 6 is the best
BEST = (
    "train.max_steps=20",
    "train.save_every=3",
    "train.eval_every=2",
    "train.eval_metrics=loss",
    "train.lr_scheduler=constant",
    "train.lr=2e-2",
    "train.keep_best=true",
    "train.early_stopping_patience=3",
)


def tensors(path):
    return load_file(path / "adapter_model.safetensors")


def held_out(run_dir):
    return [(r["step"], r["eval_loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]


def test_keep_best_and_early_stopping_need_held_out_evaluations():
    for key in ("train.keep_best=true", "train.early_stopping_patience=2"):
        assert_one_line_error(cli("validate", str(LAMP2), key), key.split("=")[0], "train.eval_every=N")
    assert_one_line_error(
        cli("validate", str(LAMP2), "train.eval_every=2", "train.early_stopping_min_delta=0.1"),
        "train.early_stopping_min_delta",
        "train.early_stopping_patience",
    )


def test_the_watch_counts_evaluations_without_an_improvement_of_min_delta():
    watch = BestWatch(keep=False, patience=2, min_delta=0.1)
    for step, loss in [(1, 5.0), (2, 4.95), (3, float("nan"))]:
        watch.update(step, loss, model=None)
    # 4.95 is the best, yet less than 0.1 better: two evaluations without an improvement
    assert (watch.best_step, watch.best_loss, watch.bad_evals, watch.exhausted) == (2, 4.95, 2, True)
    watch.update(4, 4.8, model=None)
    assert (watch.best_step, watch.bad_evals, watch.exhausted) == (4, 0, False)
    again = BestWatch(keep=False, patience=2, min_delta=0.1)
    again.load_state_dict(watch.state_dict())
    assert again == watch


@pytest.mark.slow
def test_adapter_is_the_best_and_adapter_last_the_last_and_the_run_stops_early(tmp_path):
    run_dir = tmp_path / "best"
    summary = run_train(run_dir, *BEST)
    evals = held_out(run_dir)
    assert [step for step, _ in evals] == [2, 4, 6, 8, 10, 12]
    best_step, best_loss = min(evals, key=lambda e: e[1])
    assert (summary["best_step"], summary["best_eval_loss"]) == (best_step, best_loss) == (6, best_loss)
    assert summary["early_stopped"]["step"] == summary["steps"] == 12
    assert "in 3 evaluations" in summary["early_stopped"]["reason"]
    assert summary["events"] == {"early_stopping": 1}
    assert json.loads((run_dir / "summary.json").read_text())["best_step"] == 6 and "stopped" not in summary
    assert summary["adapter_last"] == str(run_dir / "adapter-last")
    # the best is the adapter a run that ends at step 6 saves (a constant rate: the same steps)
    plain = [o for o in BEST if "keep_best" not in o and "early_stopping" not in o]
    run_train(tmp_path / "six", *plain, "train.max_steps=6")
    assert_same_tensors(tensors(run_dir / "adapter"), adapter_tensors(tmp_path / "six"))
    last = tensors(run_dir / "adapter-last")
    assert any(not torch.equal(last[k], v) for k, v in tensors(run_dir / "adapter").items())
    # the adapter config is the same peft format
    assert (run_dir / "adapter-last" / "adapter_config.json").read_text() == (
        run_dir / "adapter" / "adapter_config.json"
    ).read_text()


def _train(run_dir, *extra, resume=False):
    cmd = [sys.executable, "-m", "lcsb_cli", "train", str(LAMP2), "--output", str(run_dir), *BEST, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        cmd + ["--resume"] * resume, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_sigkill_then_resume_keeps_the_same_best_and_last_adapters_bit_for_bit(tmp_path):
    reference = tmp_path / "reference"
    whole = run_train(reference, *BEST)
    killed = tmp_path / "killed"
    # after step 6's evaluation (the best) and before the stop at 12
    kill_after_step(_train(killed), killed, 7)
    resumed = _train(killed, resume=True)
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    for name in ("adapter", "adapter-last"):
        assert_same_tensors(tensors(killed / name), tensors(reference / name))
    summary = json.loads((killed / "summary.json").read_text())
    for key in ("best_step", "best_eval_loss", "early_stopped", "steps", "final_loss"):
        assert summary[key] == whole[key], key
    assert held_out(killed) == held_out(reference)
    # a resume of the finished run stops where it stopped, the adapters unchanged
    again = _train(killed, resume=True)
    assert again.wait(timeout=600) == 0, again.stderr.read()
    assert_same_tensors(tensors(killed / "adapter"), tensors(reference / "adapter"))
    assert json.loads((killed / "summary.json").read_text())["early_stopped"] == whole["early_stopped"]


@pytest.mark.slow
def test_per_user_runs_keep_each_users_best_and_stop_each_user(tmp_path):
    dev = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_questions.json").read_text())
    two = sorted({q["user_id"] for q in dev})[:2]
    subset = [q for q in dev if q["user_id"] in two]
    golds = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_outputs.json").read_text())
    (tmp_path / "q.json").write_text(json.dumps(subset))
    ids = {q["id"] for q in subset}
    (tmp_path / "o.json").write_text(json.dumps({**golds, "golds": [g for g in golds["golds"] if g["id"] in ids]}))
    overrides = [o for o in BEST if "max_steps" not in o and "lr=" not in o]
    summary = run_train(
        tmp_path / "run",
        f"data.eval={tmp_path / 'q.json'}",
        f"data.eval_labels={tmp_path / 'o.json'}",
        "data.user=all",
        "train.max_steps=12",
        "train.lr=5e-2",
        *overrides,
    )
    assert summary["users"] == 2 and summary["early_stopped_users"] == 2
    for user in two:
        own = json.loads((tmp_path / "run" / "users" / user / "summary.json").read_text())
        evals = held_out(tmp_path / "run" / "users" / user)
        # rate 5e-2: each user's held-out loss is lowest at step 4, then three evaluations above it stop the user
        assert (own["best_step"], own["best_eval_loss"]) == min(evals, key=lambda e: e[1]) == evals[1]
        assert own["early_stopped"]["step"] == own["steps"] == evals[-1][0] == 10
        best = tensors(tmp_path / "run" / "adapters" / user)
        last = tensors(tmp_path / "run" / "users" / user / "adapter-last")
        assert any(not torch.equal(last[k], v) for k, v in best.items())
