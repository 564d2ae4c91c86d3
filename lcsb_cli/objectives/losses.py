"""The preference losses as TRL 1.16 defines them, on summed (DPO, KTO) or per-token mean (ORPO) response
log-probabilities; tests/test_objectives.py checks each loss and its gradient against TRL's own code to 1e-6.

- DPO (`DPOTrainer`, loss_type sigmoid): -log s(beta * ((c - c_ref) - (r - r_ref))). With label smoothing e it is
  conservative DPO, -(1-e) log s(beta z) - e log s(-beta z), the form TRL's sigmoid loss had before 1.0 (and its
  aot loss keeps); e = 0 (the default) is TRL 1.16's sigmoid exactly.
- ORPO (`ORPOTrainer`): the chosen responses' token-mean NLL minus lambda * mean log s(log-odds ratio), with the
  odds of a response exp(mean logp) / (1 - exp(mean logp)). No reference.
- KTO (`KTOTrainer`, loss_type kto): desirable 1 - s(beta (c - c_ref - kl)), undesirable 1 - s(beta (kl - (r -
  r_ref))), weighted, averaged over the examples; kl = mean(logp - logp_ref) over mismatched prompt/completion pairs,
  clamped at 0 and detached (the reference point, not trained through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# log(1 - exp(x)) switches form here (TRL's log1mexp, the cancellation-free branch on each side)
LN_HALF = -0.6931471805599453


def dpo_losses(
    logps: torch.Tensor, ref: torch.Tensor, beta: float, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, dict]:
    """Per-pair losses for logps and ref of shape [2, B] (chosen row, rejected row) and TRL's metrics."""
    chosen_ratio, rejected_ratio = logps[0] - ref[0], logps[1] - ref[1]
    z = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(z)
    if label_smoothing:
        losses = losses - label_smoothing * F.logsigmoid(-z)
    return losses, reward_metrics(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), logps.detach())


def orpo_loss(mean_logps: torch.Tensor, chosen_nll: torch.Tensor, lam: float) -> tuple[torch.Tensor, dict]:
    """The batch's ORPO loss for per-token mean logps [2, B] and the chosen responses' token-mean NLL."""
    chosen, rejected = mean_logps[0].float(), mean_logps[1].float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    metrics = reward_metrics(lam * chosen.detach(), lam * rejected.detach(), mean_logps.detach())
    metrics.update(
        nll_loss=float(chosen_nll.detach()),
        log_odds_ratio=float(ratio.detach().mean()),
        log_odds_chosen=float(log_odds.detach().mean()),
    )
    return chosen_nll - lam * ratio.mean(), metrics


def kto_losses(
    logps: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    weights: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, dict]:
    """Per-example losses (desirable first, then undesirable, as TRL concatenates them) for logps, ref [B], labels
    `desirable` [B] and the batch's reference point `kl` (see `kto_kl`)."""
    ratio = logps - ref
    chosen, rejected = ratio[desirable], ratio[~desirable]
    losses = torch.cat(
        (
            weights[0] * (1 - torch.sigmoid(beta * (chosen - kl))),
            weights[1] * (1 - torch.sigmoid(beta * (kl - rejected))),
        )
    )
    metrics = {"kl": float(kl)}
    if len(chosen):
        metrics.update(
            {
                "rewards/chosen": float(beta * chosen.detach().mean()),
                "logps/chosen": float(logps.detach()[desirable].mean()),
            }
        )
    if len(rejected):
        metrics.update(
            {
                "rewards/rejected": float(beta * rejected.detach().mean()),
                "logps/rejected": float(logps.detach()[~desirable].mean()),
            }
        )
    if len(chosen) and len(rejected):
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses, metrics


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: the mean log-ratio of mismatched pairs, clamped at 0, no gradient."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < LN_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor, logps: torch.Tensor) -> dict:
    """TRL's reward metrics of a pair batch: rewards (scaled log-ratios, or ORPO's scaled logps) and logps."""
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/accuracies": float((chosen > rejected).float().mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "logps/chosen": float(logps[0].mean()),
        "logps/rejected": float(logps[1].mean()),
    }
