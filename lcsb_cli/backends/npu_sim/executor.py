"""The simulated NPU: weights loaded once as resident quantized tiles, then forward products only.

Like a phone NPU's inference interface, the executor offers `load(weight) -> handle` and products of an
activation with a resident weight; it has no backward op. The input gradient `g @ W` is the same kernel
reading the same tiles through the same dequantizer, contracting over the tile's rows instead of its columns
(a kernel parameter, as `transpose_b` is in NPU matmul ops): no transposed or fp32 copy of W is ever stored.

Numerics of an fp16 product: the activation is cast to FP16, the product accumulates in fp32 (the NPU's
accumulators) and the output is written in FP16. With row protection, every row is scaled by a power of two
that brings its maximum to [0.5, 1) before each FP16 cast and unscaled after: exact for rows that were safe,
and it keeps tiny rows (input gradients are often 1e-6 and below) from flushing to zero and large rows from
overflowing. Layers calibrated as sensitive run their products in fp32 instead (on the CPU lane of the
device model: phone NPUs offer no fp32 matmul). With int8 weights, `w8a16` and `w8a8` reproduce npu-htp's
quantized HTP graphs instead (qdq.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import qdq

WEIGHT_FORMATS = ("fp16", "int8", "int4")
INT4_GROUP = 32
TILE_ROWS = 256
# a row whose max lies outside [2^-8, 2^8] (inputs) or above 2^15 (outputs) needed protection
SAFE_EXPONENT = 8


@dataclass
class Resident:
    """One weight as the NPU holds it: quantized codes and scales, nothing else."""

    name: str
    # (out_features, in_features)
    shape: tuple[int, int]
    fmt: str
    # fp16 [out, in] | int8 [out, in] | uint8 [out, in // 2] (two int4 codes a byte)
    codes: torch.Tensor
    # fp16 [out, 1] (int8, per channel) | [out, in // group] (int4)
    scales: torch.Tensor | None
    # the product precision chosen for this layer: fp16 | fp32 | w8a16 | w8a8 (int8)
    precision: str = "fp16"

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + (
            0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        )


def quantize(name: str, weight: torch.Tensor, fmt: str) -> Resident:
    """Symmetric quantization: int8 per output channel, int4 per group of 32 inputs (per channel if the
    input width is not a multiple of 32)."""
    weight = weight.detach().float()
    out_features, in_features = weight.shape
    if fmt == "fp16":
        return Resident(name, (out_features, in_features), fmt, weight.half(), None)
    if fmt == "int8":
        scales = (weight.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).half()
        codes = torch.round(weight / scales.float()).clamp(-127, 127).to(torch.int8)
        return Resident(name, (out_features, in_features), fmt, codes, scales)
    if in_features % 2:
        raise ValueError(f"{name}: int4 packing needs an even input width, got {in_features}")
    group = INT4_GROUP if in_features % INT4_GROUP == 0 else in_features
    grouped = weight.view(out_features, in_features // group, group)
    scales = (grouped.abs().amax(-1) / 7).clamp(min=1e-8).half()
    codes = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int16) + 8
    codes = codes.view(out_features, in_features).to(torch.uint8)
    return Resident(name, (out_features, in_features), fmt, codes[:, 0::2] | (codes[:, 1::2] << 4), scales)


def dequantize(res: Resident, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """The effective weights of rows `rows` in `dtype`: the one dequantizer both products read through."""
    if res.fmt == "fp16":
        return res.codes[rows].to(dtype)
    if res.fmt == "int8":
        return (res.codes[rows].float() * res.scales[rows].float()).to(dtype)
    packed = res.codes[rows]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int16) - 8
    scales = res.scales[rows].float().repeat_interleave(res.shape[1] // res.scales.shape[1], dim=1)
    return (codes.float() * scales).to(dtype)


def _row_exponents(rows: torch.Tensor) -> torch.Tensor:
    """Per row, e with max|row| = m * 2^e, m in [0.5, 1) (0 for an all-zero row)."""
    return torch.frexp(rows.abs().amax(-1, keepdim=True).float()).exponent


def to_fp16(rows: torch.Tensor, protect: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(FP16 values, per-row exponents to undo) — exponents are None without protection."""
    if not protect:
        return rows.half(), None
    exponents = _row_exponents(rows)
    return torch.ldexp(rows.float(), -exponents).half(), exponents


def from_fp16(values: torch.Tensor, exponents: torch.Tensor | None) -> torch.Tensor:
    return values.float() if exponents is None else torch.ldexp(values.float(), exponents)


def product_error(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(relative error in norm, share of the exact product's nonzeros that came out zero)."""
    norm = exact.norm().item()
    nonzero = exact != 0
    lost = ((approx == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    return ((approx - exact).norm().item() / norm if norm > 0 else 0.0), lost


@dataclass
class Calibration:
    """Worst fp16 input-gradient error seen per layer against an fp32 product of the same tiles."""

    relative_error: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, approx: torch.Tensor, exact: torch.Tensor) -> None:
        error, lost = product_error(approx, exact)
        self.relative_error[name] = max(self.relative_error.get(name, 0.0), error)
        self.underflow[name] = max(self.underflow.get(name, 0.0), lost)

    def choose(self, threshold: float) -> dict[str, str]:
        """Each calibrated layer's product precision: fp32 where fp16's error or underflow passes `threshold`."""
        return {
            name: "fp32" if error > threshold or self.underflow[name] > threshold else "fp16"
            for name, error in self.relative_error.items()
        }

    def summary(self) -> dict:
        return {
            "max_relative_error": max(self.relative_error.values(), default=0.0),
            "max_underflow": max(self.underflow.values(), default=0.0),
        }


class NpuExecutor:
    """Resident weights and their two products; `submit` runs a product on the NPU worker thread."""

    def __init__(self, fmt: str, row_protection: bool = True, overlap: bool = True):
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown NPU weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        self.fmt, self.row_protection = fmt, row_protection
        self.residents: list[Resident] = []
        self.protected_rows = 0
        # set while precision=auto calibrates
        self.calibration: Calibration | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="npu") if overlap else None

    def load(self, name: str, weight: torch.Tensor) -> Resident:
        resident = quantize(name, weight, self.fmt)
        self.residents.append(resident)
        return resident

    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents)

    def submit(self, product, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(product, *args)
        done: Future = Future()
        done.set_result(product(*args))
        return done

    def forward(self, x: torch.Tensor, res: Resident) -> torch.Tensor:
        """x @ W^T."""
        return self._product(x, res, contract_rows=False)

    def input_grad(self, grad: torch.Tensor, res: Resident) -> torch.Tensor:
        """grad @ W: the forward kernel over the same tiles, contracting over W's rows."""
        out = self._product(grad, res, contract_rows=True)
        if self.calibration is not None and res.precision == "fp16":
            self.calibration.record(res.name, out, self._product(grad, res, contract_rows=True, precision="fp32"))
        return out

    def _product(self, a: torch.Tensor, res: Resident, contract_rows: bool, precision: str | None = None):
        precision = precision or res.precision
        if precision in qdq.ACT_LEVELS:
            return self._unit_scale_product(
                a, res, contract_rows, lambda scaled: qdq.emulate(scaled, res.codes, precision, contract_rows)
            )
        rows = a.reshape(-1, a.shape[-1])
        out_features, in_features = res.shape
        if precision == "fp32":
            values, in_exp = rows.float(), None
        else:
            values, in_exp = to_fp16(rows, self.row_protection)
        compute = torch.float32 if precision == "fp32" else torch.float16
        acc = torch.zeros(rows.shape[0], in_features if contract_rows else out_features)
        for start in range(0, out_features, TILE_ROWS):
            tile_rows = slice(start, min(start + TILE_ROWS, out_features))
            # the accumulators' view of one tile
            tile = dequantize(res, tile_rows, compute).float()
            if contract_rows:
                acc += values[:, tile_rows].float() @ tile
            else:
                acc[:, tile_rows] = values.float() @ tile.T
        if precision == "fp16":
            acc = self._write_fp16(acc, in_exp)
        return acc.reshape(*a.shape[:-1], acc.shape[-1]).to(a.dtype)

    @staticmethod
    def _unit_scale_product(a: torch.Tensor, res: Resident, contract_rows: bool, product) -> torch.Tensor:
        """A product over unit-scale int8 codes (qdq.py): rows scaled on the CPU, `product(rows)` on the NPU, the
        scaling undone after."""
        scaled, exponents = qdq.npu_rows(a.reshape(-1, a.shape[-1]), res.scales, contract_rows)
        out = qdq.cpu_result(product(scaled), exponents, res.scales, contract_rows)
        return out.reshape(*a.shape[:-1], out.shape[-1]).to(a.dtype)

    def _write_fp16(self, acc: torch.Tensor, in_exp: torch.Tensor | None) -> torch.Tensor:
        values, out_exp = to_fp16(acc, self.row_protection)
        if in_exp is None:
            return from_fp16(values, out_exp)
        self.protected_rows += int(((in_exp.abs() > SAFE_EXPONENT) | (out_exp + in_exp > 15)).sum())
        return from_fp16(values, out_exp + in_exp)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
