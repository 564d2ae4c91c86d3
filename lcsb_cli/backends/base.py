"""What every backend offers the engine and job control; the hooks for simulated devices are no-ops here."""

from __future__ import annotations

import contextlib
import glob
import time
from pathlib import Path

# millidegrees C
THERMAL_ZONES = "/sys/class/thermal/thermal_zone*/temp"


class Backend:
    name = "base"
    # job control's seconds between temperature readings while a hot device pauses
    idle_poll_s = 5.0

    def autocast(self, mode: str):
        return contextlib.nullcontext()

    def prepare(self, loaded) -> None:
        """Take the loaded model (LoadedModel) before training or evaluation starts."""

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self) -> tuple[dict, list[dict]]:
        """Extra metrics for the step row, and event rows to log beside it."""
        return {}, []

    def synchronize(self) -> None:
        pass

    def held_weights(self) -> list:
        """Tensors holding frozen weights outside the model (for the memory breakdown)."""
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def temperature(self) -> float | None:
        """The device's temperature in °C: here the hottest Linux thermal zone, or None without a sensor."""
        readings = []
        for path in glob.glob(THERMAL_ZONES):
            try:
                readings.append(int(Path(path).read_text()) / 1000)
            except (OSError, ValueError):
                continue
        return max(readings) if readings else None

    def idle(self, seconds: float, sleep=time.sleep) -> bool:
        """Let the device cool for `seconds`; False when idling cannot cool it any further."""
        sleep(seconds)
        return True
