"""`quantization: gguf`: a .gguf base trained as the file holds it. The decoder's Linears keep the file's blocks
(Q4_0 ... Q6_K) and dequantize per product, forward and input gradient alike (linear.py); everything else (norms,
the embedding and LM head) comes from the file's converted checkpoint (convert.py), in the recipe's dtype. A
Linear the file stores as F32 / F16 / BF16 is kept in that type the same way. `open_packable` checks every decoder
matrix's type before anything is converted, so a file the packed layers cannot read is refused at once."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

from ...errors import BadInput
from .. import streamed
from . import convert as gguf_in
from .index import GgufIndex
from .linear import from_gguf_tensor
from .quants import check_supported

# llama.cpp stores these archs' q/k rows with the two rotary halves of each head interleaved
ROTARY_INTERLEAVED = {"llama"}


def open_packable(source: Path) -> GgufIndex:
    """The file's tensor index, once every matrix of its decoder blocks (`blk.N.*`, the Linears the packed layers
    keep) is in a type and size they read; BadInput naming the first that is not."""
    gguf_in.check_magic(source)
    index = GgufIndex(source)
    for tensor in index.tensors.values():
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            cols, rows = tensor.shape
            try:
                check_supported(tensor.name, tensor.tensor_type, (rows, cols), tensor.n_bytes)
            except BadInput as exc:
                raise BadInput(f"quantization: gguf: {exc}; quantization: none reads it dequantized") from exc
    return index


class GgufPacked(streamed.SafetensorsCheckpoint):
    """The converted checkpoint's tensors, except that decoder Linears are read packed from the GGUF file."""

    def __init__(self, checkpoint: Path, index: GgufIndex, config):
        import gguf

        super().__init__(checkpoint)
        self.arch = index.architecture
        arch_id = next((key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch), None)
        if arch_id is None:
            raise BadInput(f"quantization: gguf: the gguf package does not know the architecture {self.arch!r}")
        self.names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        self.tensors = index.tensors
        self.file_map = index.file_map
        self.config = config

    def linear(self, model, name, module, kind, dtype):
        base = self.names.get_name(name)
        tensor = self.tensors.get(f"{base}.weight") if base else None
        if tensor is None:
            raise BadInput(f"quantization: gguf: the GGUF file holds no tensor for {name} (looked for {base}.weight)")
        if tuple(reversed(tensor.shape)) != (module.out_features, module.in_features):
            raise BadInput(
                f"quantization: gguf: {tensor.name} is {list(reversed(tensor.shape))} in the file, but the model's "
                f"{name} is [{module.out_features}, {module.in_features}]"
            )
        packed = from_gguf_tensor(tensor, self.row_order(base, module.out_features), compute_dtype=dtype)
        self.drop_pages(tensor)
        if module.bias is not None:
            packed.bias = nn.Parameter(self._read(f"{name}.bias").to(dtype), requires_grad=False)
        return packed

    def drop_pages(self, tensor) -> None:
        """Hand the file pages just copied back to the kernel: read through the file's memory map, they would
        otherwise stay in the resident set until the map closes, a second copy of every packed weight at load."""
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        self.file_map.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + int(tensor.n_bytes) - start)

    def row_order(self, base: str, rows: int) -> torch.Tensor | None:
        """For each output row of the transformers layer, the file's row: transformers' GGUF loader undoes
        llama.cpp's rotary interleave of Llama's q/k rows, and the packed layer must read them the same way."""
        if self.arch not in ROTARY_INTERLEAVED or not base.endswith(("attn_q", "attn_k")):
            return None
        heads = self.config.num_attention_heads if base.endswith("attn_q") else self.config.num_key_value_heads
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
