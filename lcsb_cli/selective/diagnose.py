"""How far LCSB's surrogate gradient is from the true one: cosine and norm ratio per block and exact window."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .layers import SelectiveLayers


def surrogate_agreement(
    layers: Sequence[nn.Module], blocks: Sequence[range], loss_fn: Callable[[], torch.Tensor], windows: Sequence[int]
) -> dict[tuple[int, int], tuple[float, float]]:
    """{(block, W): (cosine, norm ratio)} of each block's gradient with W layers above it backpropagating exactly
    (identity beyond) against its true gradient (full backprop); `loss_fn` runs the model's forward and loss."""
    layer_params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    truth = _gradients(loss_fn, [p for params in layer_params for p in params])
    true_blocks = _by_block(truth, layer_params, blocks)
    agreement = {}
    for window in windows:
        selective = SelectiveLayers(layers, blocks, "identity", exact_above=window)
        try:
            for block in range(len(blocks)):
                selective.activate(block)
                got = torch.cat([g.flatten() for g in _gradients(loss_fn, selective.block_parameters(block))])
                agreement[block, window] = (
                    float(torch.nn.functional.cosine_similarity(got, true_blocks[block], dim=0)),
                    float(got.norm() / true_blocks[block].norm()),
                )
        finally:
            selective.remove()
    return agreement


def _gradients(loss_fn: Callable[[], torch.Tensor], params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss_fn(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach().float() for p, g in zip(params, grads)]


def _by_block(flat: list[torch.Tensor], layer_params: list[list[nn.Parameter]], blocks: Sequence[range]):
    per_layer, index = [], 0
    for params in layer_params:
        per_layer.append(flat[index : index + len(params)])
        index += len(params)
    return [torch.cat([g.flatten() for i in block for g in per_layer[i]]) for block in blocks]
