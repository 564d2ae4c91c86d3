"""Data parallelism on torch.distributed: the process group, LCSB-aware gradient sync, and `--nproc` launching.

Every rank runs the same schedule (same seed, and the adaptive schedule sees the synced gradients), so at each
step all ranks train the same block and only that block's LoRA parameters hold gradients: `sync_grads`
all-reduces exactly those, flattened into one buffer, 1/K of the traffic of syncing every LoRA parameter.
The loss is summed over the target tokens of the whole global batch and divided by their global count, so the
synced gradient is the gradient of the same loss a single process computes on the whole global batch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import BadInput
from ..methods import METHODS


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (nothing to do in a single process)."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def total(self, value: float) -> float:
        return float(self.all_reduce(torch.tensor(float(value), dtype=torch.float64)))

    def any(self, flag: bool) -> bool:
        return self.total(1.0 if flag else 0.0) > 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. materialising a preset into the cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def sync_grads(self, params: list[torch.nn.Parameter]) -> dict:
        """Sum the gradients that exist (the active block's) across ranks: one flat all-reduce."""
        if self.size == 1:
            return {}
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return {}
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
        return {"comm_tensors": len(grads), "comm_bytes": flat.numel() * flat.element_size()}


SINGLE = World()


def check_parallel_method(method: str) -> None:
    if not METHODS[method].data_parallel:
        raise BadInput(f"method: {method} has no gradients to share; run it in one process (no --nproc)")


def init_world(backend_name: str) -> World:
    """The process group torchrun describes in the environment (gloo on CPU, nccl on CUDA), or one process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return SINGLE
    if not dist.is_initialized():
        if backend_name == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if backend_name == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size())


def launch(nproc: int, args: list[str]) -> int:
    """Run `lcsb ARGS` under torchrun with `nproc` local processes; returns its exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "lcsb_cli",
        *args,
    ]
    return subprocess.call(command, env=env)
