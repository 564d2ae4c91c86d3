"""What every backend offers the engine; the hooks for simulated devices are no-ops here."""

from __future__ import annotations

import contextlib


class Backend:
    name = "base"

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
