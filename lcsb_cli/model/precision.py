"""Frozen weights stored in the dtype their products run in, so that bf16 autocast finds nothing to cast."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..recipe import Recipe


def store_frozen_for_autocast(model: nn.Module, autocast: str, recipe: Recipe) -> None:
    """With bf16 autocast over float32 storage, autocast casts every frozen projection to bf16 again on every
    forward (on SmolLM2-135M 294 casts, 729 MiB read a step). Stored in bf16 once, they are products' operands as
    they are. Only the frozen Linears change: the LoRA weights, the optimizer and the norms stay fp32. A head tied to
    the input embedding takes the embedding with it; its output is cast back to fp32, so the residual stream stays
    fp32 as under autocast over fp32 weights. `autocast`: the run's resolved mode (none | bf16)."""
    if autocast != "bf16" or recipe.quantization != "none" or recipe.model.dtype != "float32":
        return
    frozen = [m for m in model.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    for module in frozen:
        module.to(torch.bfloat16)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and embedding.weight is head.weight:
        embedding.register_forward_hook(_to_float32)


def _to_float32(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.float()


class CastCounter(TorchDispatchMode):
    """Counts the dtype casts (aten::_to_copy, which autocast and `.to` issue) of one step, split by whether the
    source lives in a frozen parameter's storage (a weight, or a slice of the head's rows) or not."""

    def __init__(self, model):
        super().__init__()
        self.frozen = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}
        self.counts = {"frozen weights": [0, 0], "activations and LoRA": [0, 0]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            source = args[0]
            frozen = source.untyped_storage().data_ptr() in self.frozen
            count = self.counts["frozen weights" if frozen else "activations and LoRA"]
            count[0] += 1
            count[1] += source.numel() * source.element_size()
        return func(*args, **(kwargs or {}))
