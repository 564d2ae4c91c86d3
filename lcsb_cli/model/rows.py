"""4-bit rows: an embedding / LM head weight in bitsandbytes NF4/FP4 blocks along each row, read a slice at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.func import functional_call

from ..errors import BadInput

# bitsandbytes' 4-bit block size: a row of H values is H / 64 whole blocks
ROW_BLOCK = 64


class QuantizedRows(nn.Module):
    """A [rows x cols] weight in bitsandbytes 4-bit (NF4/FP4) blocks of 64 along each row, fp32 absmax per block.

    Every row is whole blocks, so any set of rows dequantizes on its own: the embedding reads the rows of the
    batch's tokens and the LM head one vocabulary slice at a time; the full-precision matrix never exists.
    """

    def __init__(self, rows: int, cols: int, quant_type: str, device=None):
        super().__init__()
        if cols % ROW_BLOCK:
            raise BadInput(
                f"memory.embedding: 4-bit rows need a hidden size that is a multiple of {ROW_BLOCK}, "
                f"this model's is {cols}; set memory.embedding=keep"
            )
        self.shape, self.quant_type = (rows, cols), quant_type
        self.register_buffer("packed", torch.empty(rows, cols // 2, dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.empty(rows, cols // ROW_BLOCK, dtype=torch.float32, device=device))

    @classmethod
    def quantize(cls, chunks: Iterable[torch.Tensor], rows: int, cols: int, quant_type: str) -> QuantizedRows:
        """Quantize a weight given as consecutive row chunks (each freed before the next is drawn)."""
        from bitsandbytes.functional import quantize_4bit

        out = cls(rows, cols, quant_type, device="cpu")
        start = 0
        for chunk in chunks:
            packed, state = quantize_4bit(chunk.contiguous(), blocksize=ROW_BLOCK, quant_type=quant_type)
            stop = start + chunk.shape[0]
            out.packed[start:stop] = packed.view(-1, cols // 2)
            out.absmax[start:stop] = state.absmax.view(-1, cols // ROW_BLOCK)
            start = stop
        return out

    def _dequantize(self, packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from bitsandbytes.functional import QuantState, dequantize_4bit, get_4bit_type

        shape = (packed.shape[0], self.shape[1])
        state = QuantState(
            absmax=absmax.reshape(-1),
            shape=shape,
            dtype=dtype,
            blocksize=ROW_BLOCK,
            code=get_4bit_type(self.quant_type, device=packed.device),
            quant_type=self.quant_type,
        )
        return dequantize_4bit(packed.reshape(-1, 1), state)

    def slice(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.packed[start:stop], self.absmax[start:stop], dtype)

    def take(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.packed[index], self.absmax[index], dtype)


class QuantizedEmbedding(nn.Module):
    """The model's own embedding module (`lookup`, a plain nn.Embedding by default) over QuantizedRows: each call
    dequantizes only the batch's rows and hands them to the module's forward as its weight, so what its class adds
    (Gemma 3 scales by sqrt(hidden)) is kept. The rows are frozen, so padding_idx (it only masks a row's gradient)
    is dropped: over the batch's rows it would name another row."""

    def __init__(self, rows: QuantizedRows, dtype: torch.dtype, lookup: nn.Module | None = None):
        super().__init__()
        self.rows, self.dtype = rows, dtype
        self.num_embeddings, self.embedding_dim = rows.shape
        self.lookup = nn.Embedding(*rows.shape, device="meta") if lookup is None else lookup
        del self.lookup.weight
        self.lookup.padding_idx = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = self.rows.take(input_ids.reshape(-1), self.dtype)
        positions = torch.arange(len(flat), device=input_ids.device).view(input_ids.shape)
        return functional_call(self.lookup, {"weight": flat}, (positions,))


class QuantizedHead(nn.Module):
    """The LM head over QuantizedRows (shared with the embedding when they are tied), a vocabulary slice at a time.

    `causal_lm_loss` reads `weight_slice` inside its chunked cross-entropy; `forward` (evaluation, full-logits
    paths) returns ordinary logits built slice by slice.
    """

    def __init__(self, rows: QuantizedRows, slice_rows: int = 8192):
        super().__init__()
        self.rows, self.slice_rows = rows, slice_rows
        self.out_features, self.in_features = rows.shape

    def weight_slice(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self.rows.slice(start, stop, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                torch.nn.functional.linear(hidden, self.weight_slice(v, v + self.slice_rows, hidden.dtype))
                for v in range(0, self.out_features, self.slice_rows)
            ],
            dim=-1,
        )
