"""The simulated phone's CPU lane: what a decoder layer computes besides its frozen-weight products.

Per layer and direction, each operator is billed on the profile's CPU by the roofline (flops at `cpu_gflops`,
bytes at `memory_gbs`, fp32 values): the attention core's two products (QK^T and PV, 4 B L^2 h e flops forward,
so quadratic in the sequence length), and the elementwise chains: RMSNorm, the residual add fused into the
next norm's chain, RoPE on q and k, the softmax over the scores, SiLU(gate) x up, and the last residual add.
Unfused, every operator of a chain makes its own pass over memory; with `npu_sim.fuse_cpu_ops` the chain is
one kernel that reads its inputs and writes its outputs once (the NPU paper's fused CPU operators).
Backward (when the layer's own graph runs backward) costs twice the forward: products as matmul gradients,
elementwise chains read the gradient and the saved input and write the input gradient (an estimate).
These operators depend on the products around them, so they are serial segments of the step; only a
linear's adapter work overlaps its NPU product (linear.py). The LoRA products are billed by linear.py, the
LM head and the embedding's gather below.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...model.shape import LayerShape
from .device import DeviceModel

# the CPU lane computes in fp32
VALUE_BYTES = 4.0
BACKWARD = 2.0


@dataclass(frozen=True)
class Chain:
    """Elementwise operators over the same values: `flops` per value for the whole chain; unfused, `reads` and
    `writes` value-sized passes over memory (every operator's own); fused, `inputs` and `outputs` passes."""

    flops: float
    reads: int
    writes: int
    inputs: int
    outputs: int

    def passes(self, fused: bool) -> int:
        return self.inputs + self.outputs if fused else self.reads + self.writes


# square, mean, x * rsqrt(mean + eps), * weight
RMS_NORM = Chain(flops=4, reads=4, writes=3, inputs=1, outputs=1)
# residual + attention output (kept: the next residual), then RMS_NORM on it
ADD_NORM = Chain(flops=5, reads=6, writes=4, inputs=2, outputs=2)
# x * cos, rotate_half(x), * sin, add
ROPE = Chain(flops=3, reads=7, writes=4, inputs=1, outputs=1)
# max, exp(x - max), sum, divide
SOFTMAX = Chain(flops=5, reads=4, writes=2, inputs=1, outputs=1)
# sigmoid(gate), gate * sigmoid, * up
SILU_MUL = Chain(flops=5, reads=5, writes=3, inputs=2, outputs=1)
# residual + MLP output
RESIDUAL_ADD = Chain(flops=1, reads=2, writes=1, inputs=2, outputs=1)


def layer_operators(shape: LayerShape, batch: int, length: int) -> list[tuple[str, float, Chain | None]]:
    """(name, size, chain) of one decoder layer's forward on the CPU lane: the number of values a chain runs over,
    or the flops of a product (chain None)."""
    tokens = batch * length
    scores = batch * shape.heads * length * length
    return [
        ("input_norm", tokens * shape.hidden, RMS_NORM),
        ("rope", tokens * (shape.heads + shape.kv_heads) * shape.head_dim, ROPE),
        ("attention_products", 4.0 * scores * shape.head_dim, None),
        ("softmax", scores, SOFTMAX),
        ("residual_add+post_norm", tokens * shape.hidden, ADD_NORM),
        ("silu_mul", tokens * shape.intermediate, SILU_MUL),
        ("residual_add", tokens * shape.hidden, RESIDUAL_ADD),
    ]


def operation(size: float, chain: Chain | None, fused: bool) -> tuple[float, float]:
    """(flops, bytes) of an operator: a product's flops, or a chain over `size` values."""
    if chain is None:
        return size, 0.0
    return chain.flops * size, chain.passes(fused) * size * VALUE_BYTES


def layer_operations(shape: LayerShape, batch: int, length: int, fused: bool) -> list[tuple[float, float]]:
    return [operation(size, chain, fused) for _, size, chain in layer_operators(shape, batch, length)]


def layer_seconds(device: DeviceModel, shape: LayerShape, batch: int, length: int, fused: bool) -> float:
    """One decoder layer's forward on the CPU lane."""
    return sum(device.cpu_seconds(f, b) for f, b in layer_operations(shape, batch, length, fused))


def backward(operations: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(BACKWARD * flops, BACKWARD * nbytes) for flops, nbytes in operations]


def bill_layers(layers: nn.ModuleList, config, device: DeviceModel, fused: bool) -> None:
    """Bill every decoder layer's CPU-lane forward when it runs, and its backward when its own graph runs one."""
    shape = LayerShape.of(config)

    def hook(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch, length, _ = hidden.shape
        operations = layer_operations(shape, batch, length, fused)
        device.cpu(operations)
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda grad: device.cpu(backward(operations)))

    for layer in layers:
        layer.register_forward_hook(hook, with_kwargs=True)


def bill_model_ends(model: nn.Module, device: DeviceModel, fused: bool) -> None:
    """The embedding's gather (one row read and written a token), the final norm and the LM head's products."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()

    def gather(module, args, output):
        device.cpu([(0.0, 2.0 * output.numel() * VALUE_BYTES)])

    embedding.register_forward_hook(gather)
    norm = _final_norm(model)
    if norm is not None:

        def final_norm(module, args, output):
            operations = [operation(output.numel(), RMS_NORM, fused)]
            device.cpu(operations)
            if output.requires_grad:
                output.register_hook(lambda grad: device.cpu(backward(operations)))

        norm.register_forward_hook(final_norm)
    if head is not None:

        def head_products(module, args, output):
            flops = 2.0 * output.numel() * args[0].shape[-1]
            device.cpu([(flops, 0.0)])
            if output.requires_grad:
                output.register_hook(lambda grad: device.cpu([(flops, 0.0)]))

        head.register_forward_hook(head_products)


def _final_norm(model: nn.Module) -> nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    return getattr(inner, "norm", None)
