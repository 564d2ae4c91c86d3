"""The training loss: summed token cross-entropy of a causal LM, computed only where there are targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the target tokens (labels != -100); the caller normalises per step.

    The LM head runs only on the positions that predict a target: a LaMP prompt is long and its answer a few
    tokens, so full [batch x length x vocab] logits would be nearly all waste, forward and backward. Models that
    transform their logits (Gemma-2's soft-capping) take the plain full-logits path.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    targets = batch["labels"][:, 1:]
    if getattr(causal_lm.config, "final_logit_softcapping", None):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    hidden = causal_lm.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    mask = targets != -100
    logits = causal_lm.get_output_embeddings()(hidden.last_hidden_state[:, :-1][mask])
    return F.cross_entropy(logits.float(), targets[mask], reduction="sum")
