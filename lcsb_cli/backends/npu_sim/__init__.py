"""Backend `npu-sim`: frozen-weight products on a simulated phone NPU, the rest of training on the CPU.

The tensors live on the host CPU; what is simulated is the NPU's interface (resident weights, forward
products only), its numerics (FP16 with row protection, int8/int4 weights) and the phone's time, energy and
temperature (device.py). The CPU lane is billed for the adapter products (linear.py), every other operator of a
decoder layer (cpu_lane.py: norms, RoPE, the attention core, the activation, residual adds; fused or not), the
embedding, final norm and LM head, and the AdamW update.
"""

from __future__ import annotations

from ..cpu import CpuBackend
from .cpu_lane import bill_layers, bill_model_ends
from .device import DeviceModel, load_profile
from .executor import Calibration, NpuExecutor
from .linear import install


class NpuSimBackend(CpuBackend):
    name = "npu-sim"
    # simulated seconds of idle cooling per reading
    idle_poll_s = 10.0
    # precision=auto: every layer's precision until calibration chooses
    calibrating_precision = "fp16"

    def __init__(self, config):
        self.config = config
        self.profile = load_profile(config.device)
        self.device_model = DeviceModel(self.profile, config.overlap)
        self.executor = self.make_executor()
        self.trainable = 0
        # layer name -> product precision
        self.precisions: dict[str, str] = {}
        self._step = 0
        # clock events while the job paused, logged with the next step
        self._idle_events: list[dict] = []

    def make_executor(self) -> NpuExecutor:
        return NpuExecutor(self.config.weights, self.config.row_protection, self.config.overlap)

    def new_calibration(self) -> Calibration:
        return Calibration()

    @property
    def fp32_layers(self) -> list[str]:
        return [name for name, precision in self.precisions.items() if precision == "fp32"]

    def temperature(self) -> float:
        return self.device_model.temp_c

    def idle(self, seconds: float, sleep=None) -> bool:
        """Simulated cooling at the profile's idle power; no real time passes."""
        before = self.device_model.temp_c
        events = self.device_model.advance(seconds, self.profile.idle_power_w)
        self._idle_events += [self._thermal_event(e) for e in events]
        # else idle is as cool as this profile gets
        return self.device_model.temp_c < before - 1e-3

    def _thermal_event(self, event: str) -> dict:
        device = self.device_model
        return {"event": event, "sim_temp_c": device.temp_c, "sim_soc_temp_c": device.thermal.soc_c}

    def prepare(self, loaded) -> None:
        install(loaded.layers, self.executor, self.device_model)
        start = self.calibrating_precision if self.config.precision == "auto" else self.config.precision
        self._set_precisions({r.name: start for r in self.executor.residents})
        bill_layers(loaded.layers, loaded.model.config, self.device_model, self.config.fuse_cpu_ops)
        bill_model_ends(loaded.model, self.device_model, self.config.fuse_cpu_ops)
        self.trainable = sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)

    def held_weights(self) -> list:
        return [t for r in self.executor.residents for t in (r.codes, r.scales) if t is not None]

    def begin_step(self, step: int) -> None:
        self._step = step
        self.device_model.begin_step()
        calibrating = self.config.precision == "auto" and step < self.config.calibration_steps
        if calibrating and self.executor.calibration is None:
            self.executor.calibration = self.new_calibration()

    def end_step(self) -> tuple[dict, list[dict]]:
        # AdamW: ~10 flops a parameter; reads p, g, m, v and writes p, m, v in fp32
        n = self.trainable
        self.device_model.cpu([(10.0 * n, 28.0 * n)])
        metrics, thermal = self.device_model.end_step()
        step = self._step + 1
        events = [{"step": step, **e} for e in self._idle_events + [self._thermal_event(e) for e in thermal]]
        self._idle_events.clear()
        calibration = self.executor.calibration
        if calibration is not None and step >= self.config.calibration_steps:
            chosen = calibration.choose(self.config.fp32_threshold)
            self._set_precisions(self.precisions | chosen)
            calibrated = {p: sorted(n for n in chosen if chosen[n] == p) for p in sorted(set(chosen.values()))}
            events.append(
                {
                    "step": step,
                    "event": "precision",
                    "fp32_layers": self.fp32_layers,
                    "calibrated": calibrated,
                    **calibration.summary(),
                }
            )
            self.executor.calibration = None
        return {**metrics, "npu_protected_rows": self.executor.protected_rows}, events

    def _set_precisions(self, precisions: dict[str, str]) -> None:
        self.precisions = dict(sorted(precisions.items()))
        for resident in self.executor.residents:
            resident.precision = self.precisions[resident.name]

    def resident_bytes(self) -> int:
        return self.executor.resident_bytes()

    def state_dict(self) -> dict:
        calibration = self.executor.calibration
        return {
            "device": self.device_model.state_dict(),
            "precisions": self.precisions,
            "protected_rows": self.executor.protected_rows,
            "calibration": None if calibration is None else vars(calibration),
        }

    def load_state_dict(self, state: dict) -> None:
        self.device_model.load_state_dict(state["device"])
        self._set_precisions(state["precisions"])
        self.executor.protected_rows = state["protected_rows"]
        calibration = state["calibration"]
        self.executor.calibration = None if calibration is None else type(self.new_calibration())(**calibration)
