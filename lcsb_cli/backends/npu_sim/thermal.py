"""The simulated phone's temperature: two thermal nodes, advanced exactly over each interval of constant power.

The SoC (small heat capacity, seconds) takes the step's power and passes it through `soc_to_skin_c_per_w` to the
body (battery, frame and skin: large capacity, minutes), which leaks through `skin_to_ambient_c_per_w`:

    C_soc  dT_soc/dt  = P - (T_soc - T_skin) / R_soc
    C_skin dT_skin/dt = (T_soc - T_skin) / R_soc - (T_skin - T_ambient) / R_skin

The NPU clock drops to `throttle_clock` when the skin reaches `throttle_c` (the vendor's skin-temperature policy)
or the SoC reaches `junction_throttle_c` (the NPU's own passive trip), and comes back once both are
`hysteresis_c` below their limits.
"""

from __future__ import annotations

import torch


class Thermal:
    def __init__(self, profile):
        self.profile = profile
        self.soc_c = self.skin_c = profile.ambient_c
        self.throttled = False

    def advance(self, seconds: float, power_w: float) -> list[str]:
        """Let `seconds` pass at `power_w`; the throttle events this caused (npu_clock_throttled / _restored)."""
        self.soc_c, self.skin_c = self._after(seconds, power_w)
        p = self.profile
        hot = self.skin_c >= p.throttle_c or self.soc_c >= p.junction_throttle_c
        cool = self.skin_c <= p.throttle_c - p.hysteresis_c and self.soc_c <= p.junction_throttle_c - p.hysteresis_c
        if hot and not self.throttled:
            self.throttled = True
            return ["npu_clock_throttled"]
        if cool and self.throttled:
            self.throttled = False
            return ["npu_clock_restored"]
        return []

    def _after(self, seconds: float, power_w: float) -> tuple[float, float]:
        """The linear system x' = A x + b as one matrix exponential of [[A, b], [0, 0]] (exact, any step length)."""
        p = self.profile
        soc_skin = 1.0 / p.soc_to_skin_c_per_w
        skin_air = 1.0 / p.skin_to_ambient_c_per_w
        c_soc, c_skin = p.soc_heat_capacity_j_per_c, p.skin_heat_capacity_j_per_c
        system = torch.tensor(
            [
                [-soc_skin / c_soc, soc_skin / c_soc, power_w / c_soc],
                [soc_skin / c_skin, -(soc_skin + skin_air) / c_skin, skin_air * p.ambient_c / c_skin],
                [0.0, 0.0, 0.0],
            ],
            dtype=torch.float64,
        )
        state = torch.linalg.matrix_exp(system * seconds) @ torch.tensor(
            [self.soc_c, self.skin_c, 1.0], dtype=torch.float64
        )
        return float(state[0]), float(state[1])

    def state_dict(self) -> dict:
        return {"soc_c": self.soc_c, "skin_c": self.skin_c, "throttled": self.throttled}

    def load_state_dict(self, state: dict) -> None:
        self.soc_c, self.skin_c, self.throttled = state["soc_c"], state["skin_c"], state["throttled"]
