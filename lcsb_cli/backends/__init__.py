"""Where the training step runs: device placement, autocast and the memory probe."""

from __future__ import annotations

from ..errors import BadInput
from .cpu import CpuBackend
from .cuda import CudaBackend


def get_backend(name: str):
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        return CudaBackend()
    raise BadInput(f"backend: {name!r} is not available; use cpu or cuda")


__all__ = ["CpuBackend", "CudaBackend", "get_backend"]
