"""The divergence guard's slow-climb test (divergence.climb_nats, climb_window): on recorded loss curves it catches
the climbs the spike test missed and stays quiet on healthy runs; in a run, a climb returns to the state at the
lowest mean loss, and a resumed run does so exactly as an uninterrupted one."""

import json
from pathlib import Path

import pytest
import torch
from helpers import adapter_tensors, assert_same_tensors, run_train
from test_divergence import scripted, trainer_for, weights

from lcsb_cli.recipe.schema import DivergenceConfig
from lcsb_cli.run.divergence import DivergenceGuard
from lcsb_cli.run.trainer import Trainer
from lcsb_cli.rundir import read_metrics

# recorded by `lcsb train` / experiments/study_v2.py runs, each with its command (docs/RESULTS.md)
CURVES = json.loads((Path(__file__).parent / "divergence_curves.json").read_text())


def first_alarm(losses: list[float]) -> tuple[int, str] | None:
    """The first step (1-based) the guard, at the recipe's defaults, calls divergence, with its reason."""
    defaults = DivergenceConfig()
    guard = DivergenceGuard(defaults.spike_factor, defaults.patience, defaults.climb_nats, defaults.climb_window)
    for step, loss in enumerate(losses, 1):
        if (problem := guard.check(loss, 1.0)) is not None:
            return step, problem
    return None


@pytest.mark.parametrize("curve", CURVES["climbs"], ids=lambda c: c["name"])
def test_the_guard_catches_the_recorded_climbs(curve):
    alarm = first_alarm(curve["losses"])
    assert alarm is not None, curve["command"]
    low, high = curve["caught_between"]
    assert low <= alarm[0] <= high and alarm[1].startswith("loss climbed"), alarm


def test_the_spike_test_alone_misses_them():
    spikes_only = DivergenceConfig()
    for curve in CURVES["climbs"]:
        guard = DivergenceGuard(spikes_only.spike_factor, spikes_only.patience)
        assert all(guard.check(loss, 1.0) is None for loss in curve["losses"]), curve["name"]


def test_the_guard_stays_quiet_on_the_recorded_healthy_runs():
    # the 30 per-user LaMP-2 runs and the study's full-backprop and suffix runs at their validated rates
    assert len(CURVES["healthy"]) >= 36 and sum(c["name"].startswith("study ") for c in CURVES["healthy"]) >= 6
    alarms = {curve["name"]: first_alarm(curve["losses"]) for curve in CURVES["healthy"]}
    assert {name: alarm for name, alarm in alarms.items() if alarm} == {}


# from step 5 on the loss grows by 15% a step, too slowly for the spike test
CLIMB = {step: 1.0 + 0.15 * (step - 4) for step in range(5, 16)}
CLIMBING = ("method=full-backprop", "divergence.climb_window=2", "divergence.climb_nats=1.0")


def test_a_climb_returns_to_the_state_at_the_lowest_mean_loss(monkeypatch):
    monkeypatch.setattr(Trainer, "step", scripted(CLIMB))
    trainer = trainer_for(*CLIMBING, "divergence.lr_backoff=0.5")
    before, lowest = [], None
    for index in range(12):
        before.append(weights(trainer))
        row = trainer.step(index)
        if trainer.divergence.guard.improved:
            lowest = index
        if "event" in row:
            break
    assert row["event"] == "rollback" and row["reason"].startswith("loss climbed"), row
    # clean steps that set no new lowest mean came between: the last clean state is not the one returned to
    assert lowest is not None and lowest < index - 1
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before[lowest]))


def test_a_resumed_run_returns_from_a_climb_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The climb starts after the checkpoint at step 4."""
    monkeypatch.setattr(Trainer, "step", scripted(CLIMB))
    common = (*CLIMBING, "train.lr_scheduler=constant", "train.warmup_steps=0", "train.save_every=4")
    run_train(tmp_path / "whole", *common, "train.max_steps=12")
    run_train(tmp_path / "split", *common, "train.max_steps=4")
    run_train(tmp_path / "split", *common, "train.max_steps=12", resume=True)
    events = [r.get("event") for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    assert events.count("rollback") >= 1
    assert_same_tensors(adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split"))
