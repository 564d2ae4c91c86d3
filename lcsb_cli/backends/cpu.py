from __future__ import annotations

import contextlib

import torch

from ..model.memory import peak_rss_mb
from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")

    def autocast(self, mode: str):
        """bf16 autocast runs the frozen products in bf16; LoRA weights and the optimizer stay fp32."""
        if mode == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def peak_mem_mb(self) -> float:
        return peak_rss_mb()
