"""The arithmetic of an NPU product over unit-scale int8 codes with 16- or 8-bit activations (W8A16, W8A8).

npu-htp builds its HTP graphs from these ranges and npu-sim reproduces the same arithmetic in torch, so the
two agree to one output step. A compiled NPU graph has static activation ranges, so the CPU does the
dynamic part:
- it hands the NPU rows scaled by a power of two into [-1, 1) (the FP16 path's row protection), and
- it folds the per-output-channel weight scales in on its side: into the output columns after a forward
  product, into the gradient's columns before an input-gradient product. The NPU then reads one set of
  unit-scale codes both ways. Per-channel scales inside the transposed graph would sit on the summed
  dimension, which HTP accepts and computes wrongly (38-113 % error measured, no message).
The output range is what a row in [-1, 1] can reach with the layer's codes: their summed magnitude along the
contraction for W8A16 (nothing clips), four times their largest L2 norm for W8A8 (eight bits leave no room
for the worst case, so large outputs clip; calibration measures what that costs).
"""

from __future__ import annotations

import torch

# symmetric steps each side of zero (uint16 / uint8, zero point mid-range)
ACT_LEVELS = {"w8a16": 32767, "w8a8": 127}
# the fp16 graph holds codes / 128: exact in fp16, and outputs of [-1, 1) rows stay small
FP16_CODE_SCALE = 128.0


def output_range(codes: torch.Tensor, mode: str, contract_rows: bool) -> float:
    """The static output range of a unit-scale product over `codes` [out, in] for rows in [-1, 1]."""
    values = codes.float()
    summed = 0 if contract_rows else 1
    if mode == "w8a16":
        return float(values.abs().sum(summed).max().clamp(min=1.0))
    return float(4 * values.norm(dim=summed).max().clamp(min=1.0))


def npu_rows(rows: torch.Tensor, scales: torch.Tensor, contract_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows scaled into [-1, 1), per-row exponents to undo): the gradient's columns carry the channel scales."""
    rows = rows.float() * scales.float().T if contract_rows else rows.float()
    exponents = torch.frexp(rows.abs().amax(-1, keepdim=True)).exponent
    return torch.ldexp(rows, -exponents), exponents


def cpu_result(out: torch.Tensor, exponents: torch.Tensor, scales: torch.Tensor, contract_rows: bool) -> torch.Tensor:
    """Undo the row scaling; a forward product's columns get their channel scales."""
    out = torch.ldexp(out, exponents)
    return out if contract_rows else out * scales.float().T


def fake_quant(values: torch.Tensor, levels: int, step: float) -> torch.Tensor:
    """QuantizeLinear then DequantizeLinear with zero point mid-range (round half to even, clip), in float32 as
    the graph stores its scales."""
    scale = torch.tensor(step, dtype=torch.float32)
    return torch.round(values / scale).clamp(-levels - 1, levels) * scale


def emulate(rows: torch.Tensor, codes: torch.Tensor, mode: str, contract_rows: bool) -> torch.Tensor:
    """The HTP graph's arithmetic on normalized rows: quantized input, exact integer-code product, quantized output."""
    levels = ACT_LEVELS[mode]
    weights = codes.float() if contract_rows else codes.float().T
    out = fake_quant(rows, levels, 1.0 / levels) @ weights
    return fake_quant(out, levels, output_range(codes, mode, contract_rows) / levels)
