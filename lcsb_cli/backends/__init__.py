"""Where the training step runs: device placement, autocast, temperature and idling, and the simulated NPU."""

from __future__ import annotations

from .base import Backend
from .cpu import CpuBackend
from .cuda import CudaBackend


def get_backend(name: str, npu_sim=None) -> Backend:
    """The backend named `name` (the recipe's `backend`); npu-sim and npu-htp are configured by the recipe's
    npu_sim section."""
    if name == "cuda":
        return CudaBackend()
    if name == "npu-sim":
        from .npu_sim import NpuSimBackend

        return NpuSimBackend(npu_sim)
    if name == "npu-htp":
        from .npu_htp import NpuHtpBackend

        return NpuHtpBackend(npu_sim)
    return CpuBackend()


__all__ = ["Backend", "CpuBackend", "CudaBackend", "get_backend"]
