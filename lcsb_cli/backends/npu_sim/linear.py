"""Frozen linears routed through the NPU executor; LoRA adapters computed on the CPU alongside.

A LoRA linear becomes one autograd function: forward submits `x @ W^T` to the NPU worker and computes the
adapter path on the CPU meanwhile; backward submits `g @ W` and computes the adapter gradients meanwhile.
Both orders give the same numbers (the same ops on the same inputs, summed in one fixed order). A frozen
linear without LoRA is the same function with no adapter. The CPU-side weight is replaced by a meta tensor:
the NPU's resident tiles are the only copy left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import BadInput
from ...model.gguf.linear import PackedLinear
from .device import WEIGHT_BYTES, DeviceModel
from .executor import NpuExecutor, Resident


@dataclass
class NpuSite:
    """What a patched linear needs: its resident weight, the executor and the device model to bill."""

    executor: NpuExecutor
    device: DeviceModel
    resident: Resident
    bias: torch.Tensor | None

    def bill(self, rows: int, product_on_npu: bool, adapter_flops: float) -> None:
        """fp32 layers' products run on the CPU, after the adapter work."""
        out_features, in_features = self.resident.shape
        weight_bytes = out_features * in_features * WEIGHT_BYTES[self.resident.fmt]
        self.device.product(
            2.0 * rows * in_features * out_features,
            weight_bytes,
            2.0 * rows * (in_features + out_features),
            adapter_flops,
            on_npu=product_on_npu,
        )


class _NpuLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lora_x, a, b, scaling, site: NpuSite):
        job = site.executor.submit(site.executor.forward, x, site.resident)
        hidden = adapter = None
        if a is not None:
            hidden = lora_x @ a.T.to(lora_x.dtype)
            adapter = (hidden @ b.T.to(lora_x.dtype)) * scaling
        out = job.result()
        if site.bias is not None:
            out = out + site.bias.to(out.dtype)
        if adapter is not None:
            out = out + adapter
        rows = x.numel() // x.shape[-1]
        site.bill(
            rows,
            site.resident.precision != "fp32",
            0.0 if a is None else 2.0 * rows * a.shape[0] * (a.shape[1] + b.shape[0]),
        )
        ctx.site, ctx.scaling = site, scaling
        ctx.save_for_backward(lora_x, a, b, hidden)
        return out

    @staticmethod
    def backward(ctx, grad):
        site = ctx.site
        lora_x, a, b, hidden = ctx.saved_tensors
        need_x, need_lora_x, need_a, need_b = ctx.needs_input_grad[:4]
        job = site.executor.submit(site.executor.input_grad, grad, site.resident) if need_x else None
        grad_lora_x = grad_a = grad_b = None
        rows = grad.numel() // grad.shape[-1]
        adapter_flops = 0.0
        if a is not None and (need_lora_x or need_a or need_b):
            scaled = grad * ctx.scaling
            if need_b:
                grad_b = (scaled.reshape(rows, -1).T @ hidden.reshape(rows, -1)).to(b.dtype)
            grad_hidden = scaled @ b.to(scaled.dtype)
            if need_a:
                grad_a = (grad_hidden.reshape(rows, -1).T @ lora_x.reshape(rows, -1)).to(a.dtype)
            if need_lora_x:
                grad_lora_x = grad_hidden @ a.to(grad_hidden.dtype)
            adapter_flops = 2.0 * rows * a.shape[0] * (b.shape[0] * (1 + need_b) + a.shape[1] * (need_a + need_lora_x))
        grad_x = job.result() if job is not None else None
        if need_x:
            site.bill(rows, site.resident.precision != "fp32", adapter_flops)
        else:
            site.device.cpu([(adapter_flops, 0.0)])
        return grad_x, grad_lora_x, grad_a, grad_b, None, None


def _lora_forward(module, site: NpuSite):
    """Replacement forward of a peft LoRA Linear with one adapter named `default`."""
    dropout, a, b = module.lora_dropout["default"], module.lora_A["default"], module.lora_B["default"]

    def forward(x, *args, **kwargs):
        if module.disable_adapters:
            return _NpuLinear.apply(x, None, None, None, 0.0, site)
        return _NpuLinear.apply(x, dropout(x), a.weight, b.weight, module.scaling["default"], site)

    return forward


def _plain_forward(site: NpuSite):
    def forward(x):
        return _NpuLinear.apply(x, None, None, None, 0.0, site)

    return forward


def _offload(name: str, linear: nn.Linear, executor: NpuExecutor, device: DeviceModel) -> NpuSite:
    """Load the weight into the NPU and leave only a meta tensor of its shape on the CPU side. A GGUF layer's blocks
    (quantization gguf) are dequantized once into the NPU's own resident format, as a phone converts the file."""
    weight = linear.dequantized_weight() if isinstance(linear, PackedLinear) else linear.weight
    resident = executor.load(name, weight)
    placeholder = torch.empty(weight.shape, device="meta")
    if isinstance(linear, PackedLinear):
        linear.weight = placeholder
    else:
        linear.weight = nn.Parameter(placeholder, requires_grad=False)
    return NpuSite(executor, device, resident, linear.bias)


def install(layers: nn.ModuleList, executor: NpuExecutor, device: DeviceModel) -> list[Resident]:
    """Route every frozen linear inside the decoder layers through the NPU; returns their residents."""
    lora_modules = {}
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
                lora_modules[f"{index}.{name}"] = module
    bases = {id(m.base_layer) for m in lora_modules.values()}
    adapters = {id(sub) for m in lora_modules.values() for sub in (*m.lora_A.values(), *m.lora_B.values())}
    for qualified, module in lora_modules.items():
        _check_plain_lora(qualified, module)
        module.forward = _lora_forward(module, _offload(qualified, module.base_layer, executor, device))
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if (
                type(module) in (nn.Linear, PackedLinear)
                and id(module) not in bases | adapters
                and not module.weight.requires_grad
            ):
                module.forward = _plain_forward(_offload(f"{index}.{name}", module, executor, device))
    return executor.residents


def _check_plain_lora(name: str, module) -> None:
    if list(module.lora_A) != ["default"] or getattr(module, "use_dora", {}).get("default", False):
        raise BadInput(
            f"backend npu-sim / npu-htp: {name} is not a plain single-adapter LoRA linear (DoRA, several "
            "adapters); use backend=cpu"
        )
    if type(module.base_layer) not in (nn.Linear, PackedLinear):
        raise BadInput(
            f"backend npu-sim / npu-htp: {name} wraps a {type(module.base_layer).__name__}; the NPU backends "
            "need plain linear base layers (quantization none or gguf)"
        )
