"""A frozen linear layer whose weight stays in its GGUF block format, dequantized on the fly in forward and backward.

`PackedLinear` is an `nn.Linear` that never allocates a float weight: its `weight` is the uint8 block matrix
[out_features, row bytes]. Being an `nn.Linear`, peft's default LoRA dispatch wraps it (lcsb's linear-layer checks
and its MeSP hook see it too). peft puts each adapter on `weight.device` and, the weight being uint8, casts it to
`compute_dtype` only, as for bitsandbytes' Linear4bit (`get_peft_model` then upcasts bf16 adapters to float32).

The blocks are a non-persistent buffer: `.to(device)` moves them, float casts of the model leave them alone, and
no state_dict (peft's adapter files, save_pretrained, lcsb's GGUF export) holds a uint8 `...proj.weight` of the wrong
shape; a full-model save must dequantize (`dequantized_weight()`) instead. Whatever writes `weight` as a float
matrix (peft's merge, DoRA, PiSSA-like inits) fails on the shape (row bytes are never in_features): swap in an
`nn.Linear` holding `dequantized_weight()` first.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import BadInput
from .quants import check_supported, dequantize


def _weight(packed: torch.Tensor, qtype: gguf.GGMLQuantizationType, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(packed, qtype, (packed.shape[0], cols)).to(dtype)


class PackedProduct(torch.autograd.Function):
    """x W^T + b with W dequantized from the blocks in forward and again in backward (grad_x = grad W): the graph
    keeps only the blocks, which the module holds anyway, never W or x. W is frozen, so it gets no gradient."""

    @staticmethod
    def forward(ctx, x, packed, bias, qtype, cols, dtype):
        ctx.save_for_backward(packed)
        ctx.spec = (qtype, cols, dtype)
        return F.linear(x, _weight(packed, qtype, cols, dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        qtype, cols, _ = ctx.spec
        # W in the gradient's dtype: under bf16 autocast the forward's product ran in bf16, so its gradient is bf16
        grad_x = grad.matmul(_weight(packed, qtype, cols, grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None, None, None


class PackedLinear(nn.Linear):
    """`y = x W^T + b` with W kept as GGUF blocks. x is cast to `compute_dtype` (float32, or bfloat16 / float16:
    the dequantized W is cast to it) and y comes back in x's dtype, as bitsandbytes' Linear4bit does."""

    def __init__(
        self,
        packed: torch.Tensor,
        qtype: gguf.GGMLQuantizationType,
        in_features: int,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        # nn.Linear's own __init__ would allocate a float weight of out_features x in_features
        nn.Module.__init__(self)
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise BadInput(
                f"PackedLinear: the blocks must be a 2-D uint8 tensor, not {packed.dtype} {tuple(packed.shape)}"
            )
        if not compute_dtype.is_floating_point:
            raise BadInput(f"PackedLinear: compute_dtype must be a float type, not {compute_dtype}")
        check_supported("PackedLinear", qtype, (packed.shape[0], in_features), packed.numel())
        self.in_features = in_features
        self.out_features = packed.shape[0]
        self.qtype = qtype
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", packed, persistent=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with no input requiring a gradient (or under no_grad), the Function saves nothing and builds no graph
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        spec = (self.qtype, self.in_features, self.compute_dtype)
        return PackedProduct.apply(x.to(self.compute_dtype), self.weight, bias, *spec).to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features], a new tensor (for merges, export and tests)."""
        return dequantize(self.weight, self.qtype, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qtype={self.qtype.name}, compute_dtype={self.compute_dtype}"


def from_gguf_tensor(
    tensor: gguf.ReaderTensor,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> PackedLinear:
    """A PackedLinear owning a copy of a 2-D GGUF tensor's blocks (the reader's memory map can then be closed).

    The shape comes from the tensor: GGUF lists ne0 (in_features) first, so `tensor.shape` is [cols, rows]. Output
    row i of the layer is the file's row `rows[i]` (blocks never cross rows, so this is exact), and bias (given in
    the file's row order) is permuted alike.
    """
    if len(tensor.shape) != 2:
        raise BadInput(f"{tensor.name}: a linear weight has 2 dimensions, this GGUF tensor has {len(tensor.shape)}")
    cols, n_rows = (int(n) for n in tensor.shape)
    check_supported(tensor.name, tensor.tensor_type, (n_rows, cols), int(tensor.n_bytes))
    # F32 / F16 come as typed [rows, cols] arrays, the block formats as uint8 [rows, row bytes]
    data = np.asarray(tensor.data).reshape(n_rows, -1)
    if rows is not None:
        _check_permutation(tensor.name, rows, n_rows)
        data = data[rows.numpy()]
        bias = None if bias is None else bias[rows]
    packed = torch.from_numpy(np.array(data, copy=rows is None)).view(torch.uint8)
    return PackedLinear(packed, tensor.tensor_type, cols, bias, compute_dtype)


def _check_permutation(name: str, rows: torch.Tensor, n: int) -> None:
    if rows.shape != (n,) or not torch.equal(rows.sort().values, torch.arange(n)):
        raise BadInput(f"{name}: the row order must be a permutation of its {n} output rows")
