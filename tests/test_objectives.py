"""The preference losses equal TRL's own code (TRL 1.16, a test extra) on the same log-probabilities, loss and
gradient to 1e-6: DPOTrainer's and KTOTrainer's _compute_loss run unbound on a stand-in trainer and model that hand
them per-token log-probs; ORPOTrainer's odds_ratio_loss likewise."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lcsb_cli.objectives.losses import dpo_losses, kto_kl, kto_losses, orpo_loss

trl = pytest.importorskip("trl")
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

TOL = 1e-6
B, T = 4, 7


class Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(model):
        return model


class FakeModel:
    """Returns, for each input_ids tensor it was given, that tensor's per-token log-probs (zero off the response)."""

    training = True

    def __init__(self, table: dict[int, torch.Tensor]):
        self.table = table

    def __call__(self, input_ids, labels=None, **kwargs):
        log_probs = self.table[input_ids.data_ptr()]
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(
            log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=torch.zeros_like(log_probs, dtype=torch.bool)
        )


def trainer_stub(model, **fields):
    return SimpleNamespace(
        model=model,
        accelerator=Accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        **fields,
    )


def per_token(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(leaf per-token log-probs [rows, T], the response mask [rows, T + 1], input ids): responses of varied length."""
    gen = torch.Generator().manual_seed(seed)
    completion = torch.zeros(rows, T + 1, dtype=torch.long)
    for i in range(rows):
        completion[i, 2 + i % 3 :] = 1
    leaf = (-torch.rand(rows, T, generator=gen) * 3).requires_grad_()
    return leaf, completion, torch.randint(0, 50, (rows, T + 1), generator=gen)


def masked(leaf, completion):
    return leaf * completion[:, 1:]


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_equals_trl_sigmoid(beta):
    leaf, completion, ids = per_token(2 * B, 0)
    ref = -torch.rand(2, B, generator=torch.Generator().manual_seed(1)) * 20
    model = FakeModel({ids.data_ptr(): masked(leaf, completion)})
    stub = trainer_stub(
        model, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=beta
    )
    stub.use_weighting = False
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion,
        "ref_chosen_logps": ref[0],
        "ref_rejected_logps": ref[1],
    }
    theirs = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    (want,) = torch.autograd.grad(theirs, leaf)
    losses, metrics = dpo_losses(masked(leaf, completion).sum(1).view(2, -1), ref, beta)
    ours = losses.mean()
    (got,) = torch.autograd.grad(ours, leaf)
    assert abs(float(ours.detach()) - float(theirs.detach())) < TOL
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert metrics[name] == pytest.approx(stub._metrics["train"][name][0], abs=TOL), name


def test_dpo_label_smoothing_is_conservative_dpo():
    """With e > 0: -(1-e) log s(z) - e log s(-z) (TRL 1.16's sigmoid has no smoothing; its aot loss on one pair is
    this form)."""
    logps, ref = torch.tensor([[-5.0], [-9.0]]), torch.tensor([[-6.0], [-7.0]])
    z = torch.tensor(0.1 * ((-5.0 + 6.0) - (-9.0 + 7.0)))
    want = -(0.8 * torch.nn.functional.logsigmoid(z) + 0.2 * torch.nn.functional.logsigmoid(-z))
    assert float(dpo_losses(logps, ref, 0.1, 0.2)[0][0]) == pytest.approx(float(want), abs=TOL)


@pytest.mark.parametrize(("weights", "ref_kl_scale"), [((1.0, 1.0), 20.0), ((1.0, 1.33), 20.0), ((1.0, 1.0), 1.0)])
def test_kto_equals_trl(weights, ref_kl_scale):
    """ref_kl_scale 1: the mismatched pairs' log-ratio is negative, so the reference point is clamped to 0."""
    leaf, completion, ids = per_token(B, 2)
    kl_leaf, kl_completion, kl_ids = per_token(B, 3)
    gen = torch.Generator().manual_seed(4)
    ref, ref_kl = -torch.rand(B, generator=gen) * 20, -torch.rand(B, generator=gen) * ref_kl_scale
    labels = torch.tensor([True, False, True, False])
    model = FakeModel({ids.data_ptr(): masked(leaf, completion), kl_ids.data_ptr(): masked(kl_leaf, kl_completion)})
    stub = trainer_stub(
        model,
        calculate_KL=True,
        loss_type="kto",
        beta=0.1,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        ref_model=None,
    )
    stub._compute_kl_logps = lambda m, batch: KTOTrainer._compute_kl_logps(stub, m, batch)
    batch = {
        "label": labels,
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": kl_completion,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    theirs = KTOTrainer._compute_loss(stub, model, batch, return_outputs=False)
    (want,) = torch.autograd.grad(theirs, leaf)
    kl = kto_kl(masked(kl_leaf, kl_completion).sum(1), ref_kl)
    losses, metrics = kto_losses(masked(leaf, completion).sum(1), ref, labels, kl, 0.1, weights)
    ours = losses.mean()
    (got,) = torch.autograd.grad(ours, leaf)
    assert abs(float(ours.detach()) - float(theirs.detach())) < TOL
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    assert metrics["kl"] == pytest.approx(stub._metrics["train"]["kl"][0], abs=TOL)
    assert metrics["rewards/margins"] == pytest.approx(stub._metrics["train"]["rewards/margins"][0], abs=TOL)


def test_orpo_equals_trl_odds_ratio():
    gen = torch.Generator().manual_seed(5)
    mean_logps = (-torch.rand(2, B, generator=gen) * 2 - 0.05).requires_grad_()
    nll = -mean_logps[0].mean()
    stub = SimpleNamespace(beta=0.1, accelerator=Accelerator())
    ratio_losses, *_ = ORPOTrainer.odds_ratio_loss(stub, mean_logps[0], mean_logps[1])
    theirs = nll - ratio_losses.mean()
    (want,) = torch.autograd.grad(theirs, mean_logps)
    ours, _ = orpo_loss(mean_logps, nll, 0.1)
    (got,) = torch.autograd.grad(ours, mean_logps)
    assert abs(float(ours.detach()) - float(theirs.detach())) < TOL
    assert torch.allclose(got, want, atol=TOL, rtol=0)
