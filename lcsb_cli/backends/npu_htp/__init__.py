"""Backend `npu-htp`: the frozen-weight products on Qualcomm's HTP kernels (onnxruntime-qnn; on x86 its HTP
backend emulates the Hexagon NPU), everything else in torch on the CPU.

It is npu-sim with the products run for real: the same recipe section (`npu_sim`: device profile, precision,
calibration, overlap), the same resident int8 tiles and install into the decoder layers, the same simulated
phone time, energy and temperature (the emulator's own speed says nothing about a phone's). What changes is
the arithmetic, which is HTP's, and the precisions auto chooses among: W8A8, W8A16, fp16 on HTP, or fp32 on
the CPU lane, per layer, by measured input-gradient error.
"""

from __future__ import annotations

from ..npu_sim import NpuSimBackend
from .executor import HtpExecutor, ModeCalibration


class NpuHtpBackend(NpuSimBackend):
    name = "npu-htp"
    calibrating_precision = "w8a16"

    def __init__(self, config):
        super().__init__(config)
        # layers HTP failed: on the CPU lane for the rest of the run
        self.fallen: list[str] = []

    def make_executor(self) -> HtpExecutor:
        return HtpExecutor(int(self.profile.htp_arch), int(self.profile.soc_model), self.config.overlap)

    def new_calibration(self) -> ModeCalibration:
        return ModeCalibration()

    def end_step(self) -> tuple[dict, list[dict]]:
        fallen = self.executor.take_fallbacks()
        self.fallen = sorted({*self.fallen, *fallen})
        metrics, events = super().end_step()
        self._set_precisions(self.precisions)
        step = self._step + 1
        events += [{"step": step, "event": "npu_fallback", "layer": layer} for layer in fallen]
        for event in events:
            if event["event"] == "precision":
                chosen = list(self.precisions.values())
                event["precisions"] = {p: chosen.count(p) for p in sorted(set(chosen))}
        return {**metrics, "htp_compile_s": round(self.executor.compile_s, 3)}, events

    def _set_precisions(self, precisions: dict[str, str]) -> None:
        super()._set_precisions(precisions | dict.fromkeys(self.fallen, "fp32"))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fallen": self.fallen}

    def load_state_dict(self, state: dict) -> None:
        self.fallen = state["fallen"]
        super().load_state_dict(state)
