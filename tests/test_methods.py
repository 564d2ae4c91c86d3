"""Baselines in the same engine: what each method may touch, MeZO's SPSA rule, exact resume of stateful ones."""

import shutil

import pytest
import torch
from helpers import adapter_tensors, assert_same_tensors, run_train
from torch import nn

from lcsb_cli.methods import Mezo
from lcsb_cli.rundir import read_metrics
from lcsb_cli.rundir.checkpoint import load_checkpoint


def moved_layers(before: dict, after: dict) -> set[int]:
    return {int(k.split(".layers.")[1].split(".")[0]) for k in after if not torch.equal(before[k], after[k])}


def initial_adapter(tmp_path) -> dict:
    """The LoRA weights every method starts from (same seed): a 1-step run at lr ~ 0 would still move them,
    so read them from a run whose only step has lr 0 (warmup starts at 0)."""
    run_train(tmp_path / "init", "train.max_steps=1", "train.warmup_steps=1", "method=full-backprop")
    return adapter_tensors(tmp_path / "init")


def test_freeze_moves_only_the_top_layers(tmp_path):
    start = initial_adapter(tmp_path)
    run_train(tmp_path / "freeze", "method=freeze", "freeze.layers=1", "train.max_steps=3", "train.warmup_steps=0")
    assert moved_layers(start, adapter_tensors(tmp_path / "freeze")) == {3}


def test_lr_scale_multiplies_the_active_blocks_step_and_logs_the_schedules_rate(tmp_path):
    """K=2, idle_update none, one step: block 0 (layers 0-1 of 4) moves sqrt(2) as far with sqrt_k, block 1 not at
    all, and both runs log the recipe's rate."""
    start = initial_adapter(tmp_path)
    common = ("lcsb.blocks=2", "lcsb.experimental.idle_update=none", "train.max_steps=1", "train.warmup_steps=0")
    run_train(tmp_path / "plain", *common)
    run_train(tmp_path / "scaled", *common, "lcsb.experimental.lr_scale=sqrt_k")
    a, b = adapter_tensors(tmp_path / "plain"), adapter_tensors(tmp_path / "scaled")
    assert moved_layers(start, b) == {0, 1}
    for key in moved_layers_keys(start, a):
        torch.testing.assert_close(b[key] - start[key], 2**0.5 * (a[key] - start[key]), rtol=1e-4, atol=1e-7)
    rows = [read_metrics(tmp_path / name / "metrics.jsonl")[0]["lr"] for name in ("plain", "scaled")]
    assert rows[0] == rows[1] == 1e-3


def test_a_block_that_comes_back_restarts_adamw_with_on_return_reset(tmp_path):
    """Blocks 0, 1, 0 with K=2 and no idle steps: after step 3 block 0's AdamW has counted 2 steps when its moments
    are kept, and 1 when they were reset on its return (block 1: 1 either way)."""
    common = ("lcsb.blocks=2", "lcsb.experimental.idle_update=none", "train.max_steps=3", "train.save_every=3")
    counts = {}
    for mode in ("keep", "reset"):
        run_train(tmp_path / mode, *common, f"lcsb.experimental.on_return={mode}")
        _, state = load_checkpoint(tmp_path / mode / "checkpoints" / "step-3")
        counts[mode] = sorted({int(entry["step"]) for entry in state["optimizer"]["state"].values()})
    assert counts == {"keep": [1, 2], "reset": [1]}


def moved_layers_keys(before: dict, after: dict) -> list[str]:
    return [k for k in after if not torch.equal(before[k], after[k])]


def test_lisa_moves_only_the_drawn_layers(tmp_path):
    start = initial_adapter(tmp_path)
    run_train(
        tmp_path / "lisa",
        "method=lisa",
        "lisa.layers=1",
        "lisa.interval=10",
        "train.max_steps=3",
        "train.warmup_steps=0",
    )
    assert len(moved_layers(start, adapter_tensors(tmp_path / "lisa"))) == 1


def test_mezo_moves_every_lora_tensor_without_gradients(tmp_path):
    start = initial_adapter(tmp_path)
    run_train(tmp_path / "mezo", "method=mezo", "mezo.lr=1e-3", "train.max_steps=2", "train.warmup_steps=0")
    after = adapter_tensors(tmp_path / "mezo")
    assert all(not torch.equal(start[k], after[k]) for k in after)


def test_mezo_update_is_the_spsa_formula():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 2, dtype=torch.float64)), nn.Parameter(torch.randn(4, dtype=torch.float64))]
    target = [torch.randn(3, 2, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    theta = [p.detach().clone() for p in params]

    def loss_at():
        return float(sum(((p - t) ** 2).sum() for p, t in zip(params, target)))

    eps, lr = 1e-3, 0.1
    method = Mezo(params, eps=eps, seed=7)
    replay = torch.Generator().manual_seed(7)
    seed = int(torch.randint(0, 2**62, (1,), generator=replay))
    z_gen = torch.Generator().manual_seed(seed)
    z = [torch.randn(p.shape, generator=z_gen, dtype=torch.float64) for p in params]

    def loss(weights):
        return float(sum(((w - t) ** 2).sum() for w, t in zip(weights, target)))

    projected = (loss([t + eps * zi for t, zi in zip(theta, z)]) - loss([t - eps * zi for t, zi in zip(theta, z)])) / (
        2 * eps
    )
    method.zeroth_order_step(loss_at, lr)
    for p, t, zi in zip(params, theta, z):
        torch.testing.assert_close(p.detach(), t - lr * projected * zi, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "variant",
    [
        ("method=lisa", "lisa.layers=2", "lisa.interval=2"),
        ("lcsb.experimental.schedule=adaptive",),
        # a resume in the middle of a block's turn, a block that came back with fresh moments, scaled rates
        (
            "lcsb.experimental.schedule=random",
            "lcsb.experimental.switch_every=2",
            "lcsb.experimental.on_return=reset",
            "lcsb.experimental.lr_scale=sqrt_k",
        ),
        ("lcsb.upper_path=suffix", "lcsb.experimental.lr_scale=k", "lcsb.experimental.idle_update=none"),
        ("method=mezo", "mezo.lr=1e-3"),
        # rank 64: tensors of 4096 values get 8-bit moments
        ("train.optimizer=adamw8bit", "lora.rank=64"),
    ],
)
def test_stateful_methods_resume_exactly(tmp_path, variant):
    common = ("train.max_steps=7", "train.save_every=3", "lora.dropout=0.1", *variant)
    run_train(tmp_path / "whole", *common)
    cut = tmp_path / "cut"
    run_train(cut, *common)
    # an interruption after step 6: its later checkpoint, adapter and summary never happened
    shutil.rmtree(cut / "checkpoints" / "step-7")
    shutil.rmtree(cut / "adapter")
    (cut / "summary.json").unlink()
    run_train(cut, *common, resume=True)
    assert_same_tensors(adapter_tensors(cut), adapter_tensors(tmp_path / "whole"))
