"""What this machine computes fast: whether its CPU does bf16 natively, and so what `train.autocast: auto` picks."""

from __future__ import annotations

import functools
import os
from pathlib import Path

# x86 flags of native bf16 products; aarch64 lists "bf16" among its Features
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
NPU_BACKENDS = ("npu-sim", "npu-htp")


def native_bf16_flag(cpuinfo: str | None = None) -> str | None:
    """The /proc/cpuinfo flag by which this CPU computes bf16 natively, or None: bf16 would be emulated (converted
    to fp32 around every product), which is slower than fp32 itself. `LCSB_CPU_BF16=native | emulated` overrides
    the flags (the tests pin it, so that `auto` resolves alike on every host)."""
    if cpuinfo is None and os.environ.get("LCSB_CPU_BF16") in ("native", "emulated"):
        return "LCSB_CPU_BF16=native" if os.environ["LCSB_CPU_BF16"] == "native" else None
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
    words = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return next((flag for flag in BF16_FLAGS if flag in words), None)


@functools.cache
def _proc_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def host_kind() -> str:
    """The host's kind, as reports print it beside a bf16 figure."""
    flag = native_bf16_flag()
    return f"native bf16: {flag}" if flag else "emulated: no native bf16"


def choose_autocast(mode: str, backend: str) -> tuple[str, str]:
    """(none | bf16, why) for `train.autocast`. `auto` picks bf16 on cuda with bf16 support and on a CPU with
    native bf16, and none where bf16 would be emulated and on the NPU backends (which keep their own precision)."""
    if mode != "auto":
        return mode, f"train.autocast: {mode}, as the recipe says"
    if backend in NPU_BACKENDS:
        return "none", f"train.autocast: auto -> none: {backend} keeps its own product precision (npu_sim.precision)"
    if backend == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16", "train.autocast: auto -> bf16: this GPU computes bf16 natively"
        return "none", "train.autocast: auto -> none: no GPU with bf16 support here"
    flag = native_bf16_flag()
    if flag:
        return "bf16", f"train.autocast: auto -> bf16: this CPU computes bf16 natively ({flag} in /proc/cpuinfo)"
    return "none", (
        "train.autocast: auto -> none: this CPU has no native bf16 (no avx512_bf16, amx_bf16 or bf16 in "
        "/proc/cpuinfo), where emulated bf16 is slower than fp32"
    )
