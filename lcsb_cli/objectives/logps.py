"""Summed log-probabilities of each row's response (its targets, labels != -100) under the model, by the same
vocabulary-sliced head as the SFT loss (model/losses.py), one row at a time."""

from __future__ import annotations

import torch

from ..model.losses import head_cross_entropy


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """[rows] summed response log-probs of batch[prefix + input_ids / attention_mask / labels]."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {"input_ids": batch[f"{prefix}input_ids"], "attention_mask": batch[f"{prefix}attention_mask"]}
    targets = batch[f"{prefix}labels"][:, 1:]
    if getattr(causal_lm.config, "final_logit_softcapping", None):
        logits = model(**inputs).logits[:, :-1].float()
        picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return (picked * (targets != -100)).sum(1)
    hidden = causal_lm.get_decoder()(**inputs).last_hidden_state[:, :-1]
    head = causal_lm.get_output_embeddings()
    rows = [row_logp(head, hidden[i], targets[i]) for i in range(targets.shape[0])]
    return torch.stack(rows)


def row_logp(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    mask = targets != -100
    return -head_cross_entropy(head, hidden[mask], targets[mask])


def response_tokens(batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """[rows] the number of response tokens of each row."""
    return (batch[f"{prefix}labels"][:, 1:] != -100).sum(1)


def cross_entropy_rows(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token-mean NLL of rows with summed logps and token counts (ORPO's chosen NLL)."""
    return -logps.sum() / tokens.sum().clamp(min=1)
