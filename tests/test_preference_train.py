"""Preference objectives through the method axis on the tiny preset (tests/tiny_prefs.yaml): every method trains under
every objective, K=1 equals full backprop bit for bit under DPO, the reference log-probs are computed once and read
back by --resume (counted), a kill -9 then --resume gives the uninterrupted run's adapter bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, adapter_tensors, assert_same_tensors, kill_after_step, run_train

from lcsb_cli.objectives import reference
from lcsb_cli.rundir import read_metrics

PREFS = REPO / "tests" / "tiny_prefs.yaml"
# overrides' paths resolve against the working directory
FEEDBACK = (
    "data.format=feedback",
    f"data.train={REPO / 'recipes/data/prefs/feedback_train.jsonl'}",
    f"data.eval={REPO / 'recipes/data/prefs/feedback_eval.jsonl'}",
)
OBJECTIVES = ("dpo", "orpo", "kto")
METHODS = {
    "lcsb-exact": ("method=lcsb", "lcsb.upper_path=exact"),
    "lcsb-suffix": ("method=lcsb", "lcsb.upper_path=suffix"),
    "lcsb-identity": ("method=lcsb", "lcsb.upper_path=identity"),
    "full-backprop": ("method=full-backprop",),
    "full-backprop+ckpt": ("method=full-backprop", "activation_checkpointing=true"),
    "freeze": ("method=freeze", "freeze.layers=2"),
    "lisa": ("method=lisa", "lisa.layers=1"),
    "mezo": ("method=mezo",),
}
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def train(run_dir: Path, *overrides: str, resume: bool = False) -> dict:
    return run_train(run_dir, *overrides, resume=resume, recipe=PREFS)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, tuple[str, ...]]:
    """Each objective's overrides on the first 16 training rows of its file (a few steps need no more)."""
    root = tmp_path_factory.mktemp("small")
    data = REPO / "recipes" / "data" / "prefs"
    for name in ("pairs_train", "feedback_train"):
        lines = (data / f"{name}.jsonl").read_text().splitlines()[:16]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    pairs = (f"data.train={root / 'pairs_train.jsonl'}",)
    return {
        "dpo": pairs,
        "orpo": ("objective=orpo", *pairs),
        "kto": ("objective=kto", *FEEDBACK, f"data.train={root / 'feedback_train.jsonl'}"),
    }


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_under_every_objective(tmp_path, small, method, objective):
    summary = train(tmp_path / "run", "train.max_steps=3", *METHODS[method], *small[objective])
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["steps"] == 3 and not summary["diverged"]
    assert all(row["loss"] == row["loss"] for row in rows)
    logged = set().union(*(row.keys() for row in rows))
    if objective == "kto":
        # a step whose rows are all thumbs up (or all down) has no rewards of the other kind, nor a margin: as in TRL
        assert set(TRL_METRICS) - {"rewards/margins"} <= logged
        assert all(("rewards/margins" in r) == ({"rewards/chosen", "rewards/rejected"} <= r.keys()) for r in rows)
    else:
        assert set(TRL_METRICS) <= rows[-1].keys()
    assert ("kl" in rows[-1]) == (objective == "kto")
    assert (tmp_path / "run" / reference.REFERENCE_FILE).is_file() == (objective != "orpo")
    if method != "mezo":
        # an update happened: the adapter moved off its zero-initialised B
        assert any(
            float(t.abs().sum()) > 0 for name, t in adapter_tensors(tmp_path / "run").items() if "lora_B" in name
        )


def test_k1_equals_full_backprop_under_dpo(tmp_path, small):
    overrides = ("train.max_steps=4", *small["dpo"])
    train(tmp_path / "k1", *overrides, "method=lcsb", "lcsb.blocks=1", "lcsb.upper_path=exact")
    train(tmp_path / "full", *overrides, "method=full-backprop")
    assert_same_tensors(adapter_tensors(tmp_path / "k1"), adapter_tensors(tmp_path / "full"))
    losses = [[row["loss"] for row in read_metrics(tmp_path / name / "metrics.jsonl")] for name in ("k1", "full")]
    assert losses[0] == losses[1]


def test_first_dpo_loss_is_ln2_against_the_adapter_off_reference(tmp_path):
    """A fresh adapter (B = 0) is the base, so the first step's log-ratios are 0 and the loss is ln 2."""
    train(tmp_path / "run", "train.max_steps=1")
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert row["rewards/margins"] == pytest.approx(0.0, abs=1e-5)


def test_reference_is_computed_once_and_restored_by_resume(tmp_path, monkeypatch):
    calls = []
    real = reference.compute_reference
    monkeypatch.setattr(reference, "compute_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_dir = tmp_path / "run"
    train(run_dir, "train.max_steps=2", "train.save_every=2")
    assert len(calls) == 1
    saved = reference.load_reference(run_dir, 180)
    train(run_dir, "train.max_steps=4", resume=True)
    assert len(calls) == 1, "--resume recomputed the reference"
    assert_same_tensors({"t": reference.load_reference(run_dir, 180)}, {"t": saved})


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(tmp_path):
    overrides = ("train.max_steps=8", "train.save_every=2", "method=lcsb")
    train(tmp_path / "straight", *overrides)
    run_dir = tmp_path / "cut"
    command = [sys.executable, "-m", "lcsb_cli", "train", str(PREFS), "--output", str(run_dir), *overrides]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kill_after_step(proc, run_dir, 5)
    train(run_dir, *overrides, resume=True)
    assert_same_tensors(adapter_tensors(tmp_path / "straight"), adapter_tensors(run_dir))


def test_export_gguf_and_chat_work_on_a_dpo_adapter(tmp_path, small):
    """A preference-trained adapter is an adapter like any other: on lamp-tiny (a base with a chat template) the
    adapter GGUF exports and `lcsb chat` answers a turn."""
    from click.testing import CliRunner
    from helpers import cli

    from lcsb_cli.cli import app

    run_dir = tmp_path / "run"
    # lamp-tiny knows movie text only: its first-batch check would refuse the phone messages
    train(run_dir, "model.name=lamp-tiny", "train.max_steps=2", "train.check_initial_loss=false", *small["dpo"])
    proc = cli("export", str(run_dir), "--format", "gguf", "--output", str(tmp_path / "adapter.gguf"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "adapter.gguf").stat().st_size > 0
    with CliRunner().isolation(input="hello\n/exit\n") as (out, err, _):
        try:
            app(args=["chat", str(run_dir), "--max-new-tokens", "4"], prog_name="lcsb")
            code = 0
        except SystemExit as exc:
            code = exc.code
        assert code == 0, err.getvalue().decode()
        assert out.getvalue().decode().strip()
