"""The training loss: summed token cross-entropy of a causal LM, computed only where there are targets, with the
LM head applied a vocabulary slice at a time so the [targets x vocab] fp32 logits never exist at once."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BadInput

# the most one vocabulary slice may hold: its fp32 logits or its head rows
CHUNK_BYTES = 4 * 2**20
# attention implementations for which transformers builds a packed batch's block-diagonal mask
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention")


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], probe=None) -> torch.Tensor:
    """Cross-entropy summed over the target tokens (labels != -100); the caller normalises per step.

    The LM head runs only on the positions that predict a target: a LaMP prompt is long and its answer a few
    tokens, so full [batch x length x vocab] logits would be nearly all waste, forward and backward. Models that
    transform their logits (Gemma-2's soft-capping) take the plain full-logits path. `probe` (a
    memory.MemoryProbe) measures the decoder's saved activations and the head's working set. A packed batch
    (data.packing) is read through `model_inputs`.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" in batch:
        check_packable(causal_lm.config)
    targets = batch["labels"][:, 1:]
    if getattr(causal_lm.config, "final_logit_softcapping", None):
        logits = model(**model_inputs(batch)).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    with probe.decoder() if probe else contextlib.nullcontext():
        hidden = causal_lm.get_decoder()(**model_inputs(batch))
    mask = targets != -100
    with probe.head() if probe else contextlib.nullcontext():
        return head_cross_entropy(
            causal_lm.get_output_embeddings(), hidden.last_hidden_state[:, :-1][mask], targets[mask]
        )


def model_inputs(batch: dict[str, torch.Tensor]) -> dict:
    """The model's keyword arguments for a batch. A packed batch (data/packing.py: `position_ids` that restart with
    each document) goes in with its position ids and no 2D mask: transformers' masking_utils then finds the documents
    from the position ids and builds a block-diagonal causal mask (for the attention implementations it builds masks
    for: sdpa, which lcsb loads, eager and flex; `check_packable` refuses others), so no token attends across a
    document. It does so only without a cache, so `use_cache=False` (a config's default may be True). The pads at a
    row's end count from 0 again: one more document, after every real token, so no real token sees them either."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def check_packable(config) -> None:
    """A packed batch needs transformers to build its block-diagonal mask from the position ids (`model_inputs`):
    masking_utils does for these implementations; flash attention finds packed sequences only in a batch of one."""
    implementation = config._attn_implementation
    if implementation not in PACKABLE_ATTENTION:
        raise BadInput(
            f"data.packing: attention implementation {implementation!r} gets no block-diagonal mask from "
            "transformers; packed documents would attend to each other"
        )


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum_i CE(head(hidden_i), targets_i) for hidden [T, H]: chunked over the vocabulary when the head is frozen
    (a plain bias-free Linear, or a 4-bit QuantizedHead); a head that trains or adds a bias is applied whole, and so
    is one with forward hooks (npu-sim bills the head's products through one), which the chunks would bypass."""
    hooked = head._forward_hooks or head._forward_pre_hooks
    if hasattr(head, "weight_slice") and not hooked:
        return ChunkedHeadCrossEntropy.apply(hidden, targets, head.weight_slice, head.out_features)
    if type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad and not hooked:
        weight = head.weight
        return ChunkedHeadCrossEntropy.apply(
            hidden, targets, lambda a, b, dtype: weight[a:b].to(dtype), head.out_features
        )
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def vocab_slice_rows(targets: int, hidden_size: int, element_bytes: int) -> int:
    """Rows per vocabulary slice so that neither its fp32 logits nor its head rows exceed CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(targets * 4, hidden_size * element_bytes))


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ W^T` over vocabulary slices of W, with an online logsumexp.

    Forward keeps only the per-token logsumexp and target logit; backward recomputes each slice's logits and
    adds (softmax - onehot) @ W_slice to the input gradient. The head is frozen: no weight gradient. This is the
    memory scheme of Cut Cross-Entropy (Wijmans et al., 2024) and Liger's fused linear cross-entropy.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, hidden, targets, weight_slice, vocab):
        rows = vocab_slice_rows(hidden.shape[0], hidden.shape[1], hidden.element_size())
        lse = torch.full((hidden.shape[0],), float("-inf"), device=hidden.device)
        target_logit = torch.zeros(hidden.shape[0], device=hidden.device)
        compute = _compute_copy(hidden)
        for start in range(0, vocab, rows):
            logits = _slice_logits(compute, weight_slice, start, min(start + rows, vocab))
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            inside = (targets >= start) & (targets < start + logits.shape[1])
            target_logit[inside] = logits[inside, targets[inside] - start]
        ctx.save_for_backward(hidden, targets, lse)
        ctx.weight_slice, ctx.vocab, ctx.rows = weight_slice, vocab, rows
        return (lse - target_logit).sum()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_output):
        hidden, targets, lse = ctx.saved_tensors
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        compute = _compute_copy(hidden)
        for start in range(0, ctx.vocab, ctx.rows):
            stop = min(start + ctx.rows, ctx.vocab)
            weight = ctx.weight_slice(start, stop, compute.dtype)
            probs = (F.linear(compute, weight).float() - lse[:, None]).exp_()
            inside = (targets >= start) & (targets < stop)
            probs[rows[inside], targets[inside] - start] -= 1.0
            grad_hidden += (probs.to(weight.dtype) @ weight).float()
        return (grad_hidden * grad_output).to(hidden.dtype), None, None, None


def _compute_copy(hidden: torch.Tensor) -> torch.Tensor:
    """hidden in the dtype the head's products run in: autocast's, cast once here, so that each vocabulary slice of
    the head is made (cast or dequantized) straight into it and autocast finds nothing left to cast."""
    device = hidden.device.type
    return hidden.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else hidden


def _slice_logits(hidden: torch.Tensor, weight_slice, start: int, stop: int) -> torch.Tensor:
    return F.linear(hidden, weight_slice(start, stop, hidden.dtype)).float()
