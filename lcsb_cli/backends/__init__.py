"""Where the training step runs: device placement, autocast, temperature and idling, and the simulated NPU."""

from __future__ import annotations

from .base import Backend
from .cpu import CpuBackend
from .cuda import CudaBackend


def get_backend(recipe):
    """The backend a recipe names (`npu-sim` is configured by the recipe's npu_sim section)."""
    if recipe.backend == "cuda":
        return CudaBackend()
    if recipe.backend == "npu-sim":
        from .npu_sim import NpuSimBackend

        return NpuSimBackend(recipe.npu_sim)
    return CpuBackend()


__all__ = ["Backend", "CpuBackend", "CudaBackend", "get_backend"]
