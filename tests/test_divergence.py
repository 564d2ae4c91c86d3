"""Divergence edge cases: skip drops a whole run of spiking updates, a rollback leaves the LR and block schedules
in step with the data, a run resumed from a checkpoint rolls back exactly as the uninterrupted run does, and the
snapshot kept in memory, on disk or not at all."""

import pytest
import torch
from helpers import LAMP2, adapter_tensors, assert_same_tensors, cli, run_train

from lcsb_cli.errors import Diverged
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer
from lcsb_cli.run.trainer import Trainer
from lcsb_cli.rundir import read_metrics

CLEAN, SPIKE, NAN = 1.0, 100.0, float("nan")


def scripted(factors: dict[int, float]):
    """A Trainer.step that multiplies step i's loss by factors.get(i, 1): spikes and NaNs on chosen steps."""
    real_step = Trainer.step

    def step(self, index):
        clean = self.__dict__.setdefault("clean_loss", self.loss_fn)
        factor = factors.get(index, CLEAN)
        self.loss_fn = clean if factor == CLEAN else (lambda model, batch: clean(model, batch) * factor)
        return real_step(self, index)

    return step


def trainer_for(*overrides):
    recipe = load_recipe(LAMP2, ["train.warmup_steps=0", *overrides])
    trainer, loaded, _ = build_trainer(recipe)
    trainer.loss_fn = causal_lm_loss
    trainer.divergence.good.take()
    loaded.model.train()
    return trainer


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


@pytest.mark.parametrize("snapshot", ["memory", "disk"])
def test_skip_drops_every_update_of_the_spike_run(monkeypatch, snapshot):
    monkeypatch.setattr(Trainer, "step", scripted({3: SPIKE, 4: SPIKE, 5: SPIKE}))
    trainer = trainer_for(
        "method=full-backprop", "divergence.action=skip", "divergence.patience=3", f"divergence.snapshot={snapshot}"
    )
    for index in range(3):
        trainer.step(index)
    before_spikes = weights(trainer)
    rows = [trainer.step(index) for index in (3, 4, 5)]
    assert [r.get("event") for r in rows] == [None, None, "diverged"]
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before_spikes))


def test_skip_of_a_nan_caught_before_its_update_keeps_the_clean_updates(monkeypatch):
    monkeypatch.setattr(Trainer, "step", scripted({2: NAN}))
    trainer = trainer_for("method=full-backprop", "divergence.action=skip")
    trainer.step(0), trainer.step(1)
    after_clean = weights(trainer)
    assert trainer.step(2)["event"] == "diverged"
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, after_clean))


def test_rollback_keeps_the_lr_and_block_schedules_in_step_with_the_data(monkeypatch):
    setup = ("method=lcsb", "lcsb.blocks=2", "train.max_steps=8", "train.lr_scheduler=cosine")
    reference = trainer_for(*setup)
    clean_lrs = [reference.step(index)["lr"] for index in range(6)]
    monkeypatch.setattr(Trainer, "step", scripted({3: NAN}))
    trainer = trainer_for(*setup, "divergence.lr_backoff=0.5")
    rows = [trainer.step(index) for index in range(6)]
    assert rows[3]["event"] == "rollback"
    assert [r["active_block"] for r in rows] == [0, 1, 0, 1, 0, 1]
    assert trainer.lr_scheduler.last_epoch == 6
    assert [r["lr"] for r in rows[4:]] == pytest.approx([lr * 0.5 for lr in clean_lrs[4:]])


def test_a_resumed_run_rolls_back_to_the_same_state_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The spike run starts before the checkpoint at step 4 and ends after it."""
    monkeypatch.setattr(Trainer, "step", scripted({3: SPIKE, 4: SPIKE, 5: SPIKE}))
    common = (
        "method=full-backprop",
        "train.lr_scheduler=constant",
        "train.warmup_steps=0",
        "train.save_every=4",
        "divergence.action=rollback",
        "divergence.patience=3",
    )
    run_train(tmp_path / "whole", *common, "train.max_steps=7")
    run_train(tmp_path / "split", *common, "train.max_steps=4")
    run_train(tmp_path / "split", *common, "train.max_steps=7", resume=True)
    events = [r.get("event") for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    assert events.count("rollback") == 1
    assert_same_tensors(adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split"))


def test_rollback_from_the_disk_snapshot_is_bit_identical_to_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "step", scripted({3: SPIKE, 4: SPIKE, 5: SPIKE}))
    common = (
        "method=lcsb",
        "lcsb.blocks=2",
        "train.max_steps=7",
        "divergence.action=rollback",
        "divergence.patience=3",
        "train.optimizer=adamw8bit",
        # 8-bit moments: tensors and a Python step count
    )
    run_train(tmp_path / "memory", *common, "divergence.snapshot=memory")
    run_train(tmp_path / "disk", *common, "divergence.snapshot=disk")
    rows = read_metrics(tmp_path / "disk" / "metrics.jsonl")
    assert [r.get("event") for r in rows].count("rollback") == 1
    written = [r["snapshot_write_mb"] for r in rows]
    # spiking steps take no snapshot
    assert all(mb > 0 for mb in written[:4]) and written[4:6] == [0, 0]
    assert any((tmp_path / "disk" / "snapshot").iterdir())
    assert not (tmp_path / "memory" / "snapshot").exists()
    assert_same_tensors(adapter_tensors(tmp_path / "memory"), adapter_tensors(tmp_path / "disk"))


def test_the_disk_snapshot_rewrites_only_the_parameters_that_moved():
    """K=2 without idle updates: a step moves one block, so the next snapshot rewrites about half of the state."""
    trainer = trainer_for(
        "method=lcsb", "lcsb.blocks=2", "lcsb.experimental.idle_update=none", "divergence.snapshot=disk"
    )
    written = [trainer.step(index)["snapshot_write_mb"] for index in range(4)]
    whole = sum(t.nbytes for group in trainer.divergence.good.groups for t in group.values()) / 2**20
    assert 0.3 * whole < written[3] < 0.7 * whole
    # the last step's update moved one block: written
    trainer.divergence.good.take()
    assert trainer.divergence.good.written_mb() > 0
    # nothing moved since
    trainer.divergence.good.take()
    assert trainer.divergence.good.written_mb() == 0


def test_without_a_snapshot_a_divergence_stops_and_keeps_only_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "step", scripted({3: NAN}))
    with pytest.raises(Diverged, match="the last good state is the last checkpoint"):
        run_train(
            tmp_path / "run",
            "train.max_steps=6",
            "train.save_every=2",
            "divergence.action=stop",
            "divergence.snapshot=none",
        )
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-2"]
    assert not (tmp_path / "run" / "adapter").exists()
    refused = cli("validate", str(LAMP2), "divergence.snapshot=none")
    assert refused.returncode == 2 and "divergence.snapshot: none keeps no state to rollback to" in refused.stderr
