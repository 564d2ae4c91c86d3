"""LoRA with a hand-written backward that saves only the layer input (MeSP's memory-efficient LoRA backward).

peft's LoRA linear runs `lora_B(lora_A(x.to(fp32))) * scaling` under autograd, which keeps, per adapted layer,
the fp32 copy of x that lora_A reads (its own copy when the model computes in bf16: q, k and v each keep one) and
`xA^T`, which lora_B reads. `LoraDelta` keeps x as the layer received it (shared with the frozen product and the
layer's siblings) and recomputes `xA^T` in backward:

    u = x A^T                  (recomputed, tokens x r)
    dB = s g^T u,  gB = s g B,  dA = gB^T x,  dx = gB A

The frozen product's own input gradient (g W0) stays with autograd. `lora.backward: mesp` builds these layers
through peft's custom-module hook, so adapters save, load and merge as peft's own.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear


class LoraDelta(torch.autograd.Function):
    """`(x A^T) B^T * scaling`, saving x, A and B only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
        ctx.save_for_backward(x, a, b)
        ctx.scaling = scaling
        # peft's own kernels: the same forward, bit for bit
        return F.linear(F.linear(x.to(a.dtype), a), b) * scaling

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, b = ctx.saved_tensors
        rows = x.to(a.dtype).reshape(-1, x.shape[-1])
        g = grad.to(a.dtype).reshape(-1, grad.shape[-1]) * ctx.scaling
        g_b = g @ b
        grad_b = g.t() @ (rows @ a.t()) if ctx.needs_input_grad[2] else None
        grad_a = g_b.t() @ rows if ctx.needs_input_grad[1] else None
        grad_x = (g_b @ a).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, grad_b, None


class MespLinear(PeftLoraLinear):
    """peft's LoRA Linear (merge, save and load unchanged) whose plain-LoRA forward goes through `LoraDelta`."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters or self.merged or self.lora_variant or "adapter_names" in kwargs:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        dtype = result.dtype
        four_bit = isinstance(self.get_base_layer(), bnb.nn.Linear4bit)
        for name in self.active_adapters:
            if name in self.lora_A:
                delta = LoraDelta.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])
                # each as peft's own layer adds it
                result = result + (delta.to(dtype) if four_bit else delta)
        return result.to(dtype)


def use_mesp(lora_config) -> None:
    """Have peft build every adapted linear (4-bit ones included: bitsandbytes' Linear4bit is an nn.Linear) as a
    `MespLinear`."""
    lora_config._register_custom_module({torch.nn.Linear: MespLinear})
