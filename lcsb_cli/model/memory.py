"""Memory-lean training settings and their measurement: allocator and kernel-cache settings
and the peak-RSS breakdown of summary.json and the bench."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import resource
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# glibc mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
# the highest peak before the last reset_peak_rss
_EARLIER_PEAK_MB = 0.0


def rss_mb() -> float:
    """The process's resident set size now (anonymous + file-backed pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@functools.cache
def runtime_rss_mb() -> float:
    """The RSS when this process first loaded a model: the interpreter and its libraries. A later load (the next
    user of a per-user run) fills heap that earlier runs freed and glibc kept, so its own RSS at load would count
    that heap twice; it is the `other` part instead."""
    return rss_mb()


def peak_rss_mb() -> float:
    """The OS's peak resident set size of this process since it started or since `reset_peak_rss`: Linux's VmHWM,
    else ru_maxrss (KiB on Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Restart the high-water mark at the current RSS (Linux: 5 written to /proc/self/clear_refs), so that a run
    inside a longer process (one user of a per-user run) reports its own peak; elsewhere a no-op. The mark so far
    is kept for `process_peak_rss_mb`."""
    global _EARLIER_PEAK_MB
    _EARLIER_PEAK_MB = max(_EARLIER_PEAK_MB, peak_rss_mb())
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def process_peak_rss_mb() -> float:
    """The peak RSS of the whole process, across every `reset_peak_rss`."""
    return max(_EARLIER_PEAK_MB, peak_rss_mb())


def release_freed_memory() -> None:
    """Free what reference cycles hold (a finished run's model and optimizer), then hand the heap glibc kept back to
    the OS (`malloc_trim(0)`, every arena): between the users of a per-user run, whose next model and batches would
    otherwise land in a heap fragmented by the last."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def configure_allocator(mmap_threshold_kb: int) -> bool:
    """glibc malloc: blocks of `mmap_threshold_kb` and more get their own mmap and go back to the OS when freed.

    Left alone, glibc raises the threshold (up to 32 MiB) as large blocks are freed, so a step's transient
    tensors and the LoRA tensors and moments that appear as blocks first train (8-311 KB each for r=16) share
    one heap whose fragmented high-water mark stays resident. False when the C library is not glibc."""
    libc = _glibc()
    if mmap_threshold_kb <= 0 or libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold_kb * 1024))


def limit_kernel_caches(entries: int) -> None:
    """Cap oneDNN's primitive cache and PyTorch's ideep LRU cache (1024 entries each by default). bf16 matmuls
    cache a compiled kernel per input shape, so batches of varying length grow the process by a few MB each;
    read when the first oneDNN kernel is created, so this must run before any matmul. Values already in the
    environment win."""
    if entries > 0:
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
        os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive (`live`), and their high-water mark."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result: no new storage
        if any(ret.alias_info for ret in func._schema.returns):
            return out
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and in_host_memory(tensor):
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += size
                    weakref.finalize(storage, self._free, key, size)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


class MemoryProbe:
    """Per-step figures for the breakdown, each the largest over the run: bytes the decoder's forward saves for
    backward (activations; parameters and frozen weights excluded), the LM head cross-entropy's working set
    (logits: its peak of live tensors) and the gradients accumulated into the LoRA parameters."""

    def __init__(self, model: nn.Module):
        self.activations = self.logits = self.grads = 0
        self._owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self._step_grads = 0
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_arrived)

    @contextlib.contextmanager
    def decoder(self):
        saved: dict[int, int] = {}

        def pack(tensor):
            key = tensor.untyped_storage().data_ptr()
            if key not in self._owned and in_host_memory(tensor):
                saved[key] = tensor.untyped_storage().nbytes()
            return tensor

        self._step_grads = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.activations = max(self.activations, sum(saved.values()))

    @contextlib.contextmanager
    def head(self):
        with LiveBytes() as live:
            yield
        self.logits = max(self.logits, live.peak)

    def _grad_arrived(self, param) -> None:
        self._step_grads += param.grad.nbytes if in_host_memory(param.grad) else 0
        self.grads = max(self.grads, self._step_grads)


def frozen_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The base model's weights: frozen parameters, buffers and the 4-bit layers' quantization statistics."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if not t.requires_grad]
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            tensors += [t for t in state.as_dict().values() if torch.is_tensor(t)]
    return tensors


def in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether the tensor's bytes are part of this process's RSS (not meta, not on an accelerator)."""
    return not tensor.is_meta and tensor.device.type == "cpu"


def breakdown(
    model: nn.Module, probe: MemoryProbe, runtime_mb: float, held_weights: Iterable[torch.Tensor] = ()
) -> dict:
    """The process's peak RSS (the OS's, since the run began: `peak_rss_mb`) beside what it is made of: the runtime (RSS
    when the model began loading: `LoadedModel.runtime_mb`), frozen weights (the model's, plus `held_weights`: a
    backend's own copies such as npu-sim's resident tiles), LoRA + optimizer (every live tensor now that is not a frozen
    weight: LoRA weights, optimizer state and any copies, plus the largest step's gradients), and the activations and
    logits of the run's `probe`. Only host memory counts: on CUDA the parts describe the host process alone. `other_mb`
    is the rest: allocator slack, transient dequantized weights and recomputation, data, and libraries imported after
    loading."""
    frozen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*frozen_tensors(model), *held_weights]
        if in_host_memory(t)
    }
    live = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and in_host_memory(obj):
            live[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    mb = 2**-20
    figures = {
        "runtime_mb": runtime_mb,
        "weights_mb": sum(frozen.values()) * mb,
        "lora_optimizer_mb": (sum(n for key, n in live.items() if key not in frozen) + probe.grads) * mb,
        "activations_mb": probe.activations * mb,
        "logits_mb": probe.logits * mb,
    }
    peak = peak_rss_mb()
    return {
        "peak_rss_mb": peak,
        **{k: round(v, 1) for k, v in figures.items()},
        "other_mb": round(peak - sum(figures.values()), 1),
    }


def rebased(figures: dict, peak_mb: float) -> dict:
    """A `breakdown` set against a higher peak (a per-user run's whole process, evaluations included): the same
    parts, the difference added to `other_mb`."""
    parts = sum(value for key, value in figures.items() if key not in ("peak_rss_mb", "other_mb"))
    return {**figures, "peak_rss_mb": peak_mb, "other_mb": round(peak_mb - parts, 1)}


@contextlib.contextmanager
def seeded(seed: int):
    """Run with the CPU RNG seeded, restoring its state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
