from __future__ import annotations

import torch

from ..errors import BadInput
from .base import Backend


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self):
        if not torch.cuda.is_available():
            raise BadInput("backend: cuda asked for, but torch sees no CUDA device; use backend=cpu")
        self.device = torch.device("cuda", torch.cuda.current_device())
        # a backend a run: its peak is its own, not the process's so far (a per-user run's users share a process)
        torch.cuda.reset_peak_memory_stats(self.device)

    def autocast(self, mode: str):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16")

    def peak_mem_mb(self) -> float:
        """The caching allocator's peak of memory handed to tensors, since this backend was made."""
        return torch.cuda.max_memory_allocated(self.device) / 2**20

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def temperature(self) -> float | None:
        """The GPU's own sensor (through NVML), else the host's thermal zones."""
        try:
            return float(torch.cuda.temperature(self.device))
        # no NVML / no sensor
        except Exception:
            return super().temperature()
