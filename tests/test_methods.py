"""Baselines in the same engine: what each method may touch, MeZO's SPSA rule, exact resume of stateful ones."""

import shutil

import pytest
import torch
from helpers import adapter_tensors, assert_same_tensors, run_train
from torch import nn

from lcsb_cli.methods import Mezo


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
        ("lcsb.schedule=adaptive",),
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
