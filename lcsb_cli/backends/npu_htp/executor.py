"""npu-sim's resident int8 tiles and product interface, with the products run by Qualcomm's HTP kernels.

Each layer gets one graph per (precision, direction), built when first used: the forward product (also what
recomputation runs) and the input-gradient product over the same unit-scale int8 codes. Rows go in scaled
into [-1, 1) with the channel scales folded in on the CPU (qdq.py), so the same arithmetic runs in npu-sim.
A product HTP fails twice moves that layer to the CPU lane (fp32 over the same tiles), reported as an
`npu_fallback` event; the run goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import qdq
from ..npu_sim.executor import NpuExecutor, Resident, product_error
from .graphs import product_graph
from .session import HtpError, HtpGraph, provider_options

# cheapest first: auto takes the first whose error passes
HTP_PRECISIONS = ("w8a8", "w8a16", "fp16")
# HTP compiles static shapes: products run 64 rows at a time, the last block zero-padded
GRAPH_ROWS = 64


@dataclass
class ModeCalibration:
    """Worst input-gradient error per layer and HTP precision, against fp32 over the same tiles."""

    relative_error: dict[str, dict[str, float]] = field(default_factory=dict)
    underflow: dict[str, dict[str, float]] = field(default_factory=dict)

    def record(self, name: str, precision: str, approx: torch.Tensor, exact: torch.Tensor) -> None:
        error, lost = product_error(approx, exact)
        for table, value in ((self.relative_error, error), (self.underflow, lost)):
            seen = table.setdefault(name, {})
            seen[precision] = max(seen.get(precision, 0.0), value)

    def choose(self, threshold: float) -> dict[str, str]:
        """Each calibrated layer's cheapest precision whose error and underflow stay within `threshold`, else fp32."""
        return {
            name: next(
                (p for p in HTP_PRECISIONS if errors[p] <= threshold and self.underflow[name][p] <= threshold), "fp32"
            )
            for name, errors in self.relative_error.items()
        }

    def summary(self) -> dict:
        return {
            "max_relative_error": {
                p: max((e[p] for e in self.relative_error.values()), default=0.0) for p in HTP_PRECISIONS
            }
        }


class HtpExecutor(NpuExecutor):
    """Resident int8 weights whose products run on HTP graphs (CPU fallback disabled)."""

    def __init__(self, htp_arch: int, soc_model: int, overlap: bool = True):
        super().__init__("int8", row_protection=True, overlap=overlap)
        self.htp_arch, self.soc_model = htp_arch, soc_model
        self.graphs: dict[tuple[str, str, bool], HtpGraph] = {}
        # layers moved to the CPU lane since the last report
        self.fallbacks: list[str] = []
        self.compile_s = 0.0
        self.calibration: ModeCalibration | None = None

    def input_grad(self, grad: torch.Tensor, res: Resident) -> torch.Tensor:
        if self.calibration is None or res.precision == "fp32":
            return self._product(grad, res, contract_rows=True)
        exact = self._product(grad, res, contract_rows=True, precision="fp32")
        results = {p: self._product(grad, res, contract_rows=True, precision=p) for p in HTP_PRECISIONS}
        for precision, approx in results.items():
            self.calibration.record(res.name, precision, approx, exact)
        return results.get(res.precision, exact)

    def _product(self, a: torch.Tensor, res: Resident, contract_rows: bool, precision: str | None = None):
        precision = precision or res.precision
        if precision == "fp32":
            return super()._product(a, res, contract_rows, "fp32")
        try:
            return self._unit_scale_product(
                a, res, contract_rows, lambda rows: self._run(res, precision, contract_rows, rows)
            )
        except HtpError:
            self.fallbacks.append(res.name)
            res.precision = "fp32"
            return super()._product(a, res, contract_rows, "fp32")

    def _run(self, res: Resident, precision: str, contract_rows: bool, rows: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(self.graph(res, precision, contract_rows).run(rows.detach().numpy()))
        return out * qdq.FP16_CODE_SCALE if precision == "fp16" else out

    def graph(self, res: Resident, precision: str, contract_rows: bool) -> HtpGraph:
        key = (res.name, precision, contract_rows)
        if key not in self.graphs:
            started = time.perf_counter()
            codes = res.codes.numpy()
            model = product_graph(
                codes,
                GRAPH_ROWS,
                precision,
                contract_rows,
                qdq.output_range(res.codes, precision, contract_rows) if precision != "fp16" else 0.0,
            )
            direction = "input-grad" if contract_rows else "forward"
            self.graphs[key] = HtpGraph(
                f"layer {res.name} ({precision} {direction})", model, provider_options(self.htp_arch, self.soc_model)
            )
            self.compile_s += time.perf_counter() - started
        return self.graphs[key]

    def take_fallbacks(self) -> list[str]:
        """The layers that fell back since the last call, each once (calibration tries several graphs a layer)."""
        taken, self.fallbacks = list(dict.fromkeys(self.fallbacks)), []
        return taken
