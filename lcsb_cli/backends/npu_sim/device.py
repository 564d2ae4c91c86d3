"""Simulated phone: per-product roofline times on an NPU and a CPU lane, energy, and a two-node thermal model.

A product's time is max(flops / throughput, bytes / memory bandwidth) plus, on the NPU, a launch overhead.
Work that runs concurrently (an NPU product and the CPU's adapter work of the same linear, when overlap is
on) costs the longer of the two; the rest adds up. Energy is each unit's active power times its busy time
plus the idle floor over the step. The step's mean power heats the phone (thermal.py: SoC and skin), which
throttles the NPU clock when hot.

Every segment also keeps its work as (flops, bytes) operations, so the same step is priced for the paper's
baselines: a CPU trainer (every operation on the CPU, one after another) and a mobile-GPU trainer (every
operation a GPU kernel: roofline at `gpu_fp32_gflops` x `gpu_efficiency`, plus `gpu_launch_us` each).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ...errors import BadInput
from ...paths import CONFIGS_DIR
from .thermal import Thermal

DEVICE_DIR = CONFIGS_DIR / "devices"
WEIGHT_BYTES = {"fp16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    # dense fp16 matmul peak
    npu_fp16_tflops: float
    # fraction of peak a training-sized matmul reaches
    npu_efficiency: float
    # fixed cost of one NPU product (graph launch, sync)
    npu_launch_us: float
    # NPU active power
    npu_power_w: float
    # sustained fp32 matmul throughput of the cores the trainer uses
    cpu_gflops: float
    # those cores' active power
    cpu_power_w: float
    # SoC + DRAM floor while the job runs
    idle_power_w: float
    # DRAM bandwidth
    memory_gbs: float
    # the SoC node of the thermal model (thermal.py)
    soc_heat_capacity_j_per_c: float
    soc_to_skin_c_per_w: float
    # the body: battery, frame, skin
    skin_heat_capacity_j_per_c: float
    skin_to_ambient_c_per_w: float
    ambient_c: float
    # skin temperature at which the NPU clock drops
    throttle_c: float
    # SoC temperature at which it drops
    junction_throttle_c: float
    # NPU clock factor while throttled
    throttle_clock: float
    hysteresis_c: float
    # mobile GPU (Adreno) fp32 peak, the GPU-trainer baseline
    gpu_fp32_gflops: float
    # fraction of that peak a training kernel reaches
    gpu_efficiency: float
    # per kernel dispatch
    gpu_launch_us: float
    # npu-htp: the Hexagon architecture QNN compiles for (e.g. 75)
    htp_arch: float
    # npu-htp: QNN's id of the SoC (its fp16 kernels need it)
    soc_model: float


def device_names() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def load_profile(name: str) -> DeviceProfile:
    """A profile from configs/devices/NAME.yaml, or from a YAML file path."""
    path = DEVICE_DIR / f"{name}.yaml" if name in device_names() else Path(name).expanduser()
    if not path.is_file():
        raise BadInput(f"npu_sim.device: {name!r} is neither a profile ({', '.join(device_names())}) nor a file")
    try:
        data = yaml.safe_load(path.read_text())
        fields = {f.name for f in dataclasses.fields(DeviceProfile)} - {"name"}
        missing = sorted(fields - set(data or {}))
        if missing:
            raise BadInput(f"npu_sim.device: {path} lacks {', '.join(missing)}")
        return DeviceProfile(name=path.stem, **{k: float(data[k]) for k in fields})
    except (yaml.YAMLError, TypeError, ValueError, AttributeError) as exc:
        raise BadInput(f"npu_sim.device: {path} is not a valid device profile ({exc})".splitlines()[0]) from exc


class DeviceModel:
    """Accumulates one step's work, then turns it into simulated time, energy and temperature."""

    def __init__(self, profile: DeviceProfile, overlap: bool = True):
        self.profile, self.overlap = profile, overlap
        self.thermal = Thermal(profile)
        self.throttled_s = 0.0
        # (npu seconds, cpu seconds) run side by side
        self._segments: list[tuple[float, float]] = []
        # every operation's (flops, bytes), for the other trainers
        self._work: list[tuple[float, float]] = []

    @property
    def temp_c(self) -> float:
        """The skin's temperature: what a phone's thermal policy and the overnight job watch."""
        return self.thermal.skin_c

    @property
    def throttled(self) -> bool:
        return self.thermal.throttled

    @property
    def clock(self) -> float:
        return self.profile.throttle_clock if self.throttled else 1.0

    def npu_seconds(self, flops: float, weight_bytes: float, activation_bytes: float) -> float:
        p = self.profile
        compute = flops / (p.npu_fp16_tflops * 1e12 * p.npu_efficiency * self.clock)
        return max(compute, (weight_bytes + activation_bytes) / (p.memory_gbs * 1e9)) + p.npu_launch_us * 1e-6

    def cpu_seconds(self, flops: float, nbytes: float = 0.0) -> float:
        p = self.profile
        return max(flops / (p.cpu_gflops * 1e9), nbytes / (p.memory_gbs * 1e9))

    def product(
        self, flops: float, weight_bytes: float, activation_bytes: float, adapter_flops: float, on_npu: bool = True
    ) -> None:
        """A frozen-weight product (on the NPU, or on the CPU for an fp32 layer) and its adapter work on the CPU."""
        self._work += [(flops, weight_bytes + activation_bytes), (adapter_flops, 0.0)]
        if on_npu:
            self._segments.append(
                (self.npu_seconds(flops, weight_bytes, activation_bytes), self.cpu_seconds(adapter_flops))
            )
        else:
            self._segments.append((0.0, self.cpu_seconds(flops + adapter_flops)))

    def cpu(self, operations: list[tuple[float, float]]) -> None:
        """Operations (flops, bytes) that run one after another on the CPU lane, serial with the NPU."""
        self._work += operations
        self._segments.append((0.0, sum(self.cpu_seconds(f, b) for f, b in operations)))

    def begin_step(self) -> None:
        self._segments.clear()
        self._work.clear()

    def cpu_trainer_seconds(self) -> float:
        return sum(self.cpu_seconds(f, b) for f, b in self._work)

    def gpu_trainer_seconds(self) -> float:
        p = self.profile
        return sum(
            max(f / (p.gpu_fp32_gflops * 1e9 * p.gpu_efficiency), b / (p.memory_gbs * 1e9)) + p.gpu_launch_us * 1e-6
            for f, b in self._work
            if f or b
        )

    def end_step(self) -> tuple[dict, list[str]]:
        """This step's metrics, and the thermal events it caused (npu_clock_throttled, npu_clock_restored)."""
        npu = sum(n for n, _ in self._segments)
        cpu = sum(c for _, c in self._segments)
        elapsed = sum(max(n, c) if self.overlap else n + c for n, c in self._segments)
        p = self.profile
        energy = p.npu_power_w * npu + p.cpu_power_w * cpu + p.idle_power_w * elapsed
        was_throttled = self.throttled
        events = self.advance(elapsed, energy / elapsed if elapsed else p.idle_power_w)
        if was_throttled:
            self.throttled_s += elapsed
        metrics = {
            "sim_step_time_s": elapsed,
            "sim_energy_j": energy,
            "sim_temp_c": self.temp_c,
            "sim_soc_temp_c": self.thermal.soc_c,
            "npu_util": npu / elapsed if elapsed else 0.0,
            "sim_npu_s": npu,
            "sim_cpu_s": cpu,
            "sim_cpu_trainer_s": self.cpu_trainer_seconds(),
            "sim_gpu_trainer_s": self.gpu_trainer_seconds(),
        }
        return metrics, events

    def advance(self, seconds: float, power_w: float) -> list[str]:
        """Let `seconds` pass at mean power `power_w`; cooling while idle is `advance(s, idle_power_w)`."""
        return self.thermal.advance(seconds, power_w)

    def state_dict(self) -> dict:
        return {"thermal": self.thermal.state_dict(), "throttled_s": self.throttled_s}

    def load_state_dict(self, state: dict) -> None:
        """Checkpoints from the one-node model (before the SoC node) resume with both nodes at their temperature."""
        one_node = {"soc_c": state.get("temp_c"), "skin_c": state.get("temp_c"), "throttled": state.get("throttled")}
        self.thermal.load_state_dict(state.get("thermal", one_node))
        self.throttled_s = state["throttled_s"]
