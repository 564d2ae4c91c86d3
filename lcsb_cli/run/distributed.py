"""Data parallelism on torch.distributed: the process group, LCSB-aware gradient sync, and `--nproc` launching.

Every rank runs the same schedule (same seed, and the adaptive schedule sees the synced gradients), so at each
step all ranks train the same block and only that block's LoRA parameters hold gradients: `sync_grads`
all-reduces exactly those, flattened into one buffer, 1/K of the traffic of syncing every LoRA parameter.
The loss is summed over the target tokens of the whole global batch and divided by their global count, so the
synced gradient is the gradient of the same loss a single process computes on the whole global batch.

Across nodes the world is torchrun's as well: `launch` runs torchrun's agent in this process with the node flags
passed through, so a failed rank or a lost rendezvous ends in one line here instead of the agent's traceback, and a
collective that loses a peer raises `PeerLost`, one line on every surviving rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import BadInput, LcsbError
from ..methods import METHODS


class PeerLost(LcsbError):
    """A collective failed: another rank's process or node stopped (or failed, and said why on its own stderr)."""


def _collective(fn):
    """Turn a failed collective (gloo's reset connection, nccl's abort) into PeerLost, one line naming the way on."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as exc:
            raise PeerLost(
                f"rank {self.rank} of {self.size} lost the other ranks ({_reason(exc)}): a process or node stopped, "
                "and every rank stops; continue from the last checkpoint with the same command and --resume on "
                "every node (the same world: --nnodes x --nproc)"
            ) from exc

    return wrapper


def _reason(exc: Exception) -> str:
    """gloo's `[.../pair.cc:537] Read error [127.0.0.1]:53932: Connection reset by peer. This is typically ...`
    -> `Read error [127.0.0.1]:53932: Connection reset by peer`."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @_collective
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (nothing to do in a single process)."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def total(self, value: float) -> float:
        return float(self.all_reduce(torch.tensor(float(value), dtype=torch.float64)))

    def any(self, flag: bool) -> bool:
        return self.total(1.0 if flag else 0.0) > 0

    @_collective
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

    @_collective
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


@dataclass(frozen=True)
class Nodes:
    """torchrun's node flags as `lcsb train` takes them (`tune run` passes them alike). One node and no endpoint:
    torchrun's `--standalone`; else a rendezvous every node joins at `endpoint`, c10d unless `backend` names another
    (static: `node_rank` orders the nodes)."""

    nnodes: int = 1
    node_rank: int | None = None
    endpoint: str | None = None
    run_id: str | None = None
    backend: str | None = None

    def torchrun_flags(self, nproc: int) -> list[str]:
        local = [f"--nproc-per-node={nproc}"]
        if self.nnodes == 1 and self.endpoint is None:
            return ["--standalone", *local]
        if self.endpoint is None:
            raise BadInput(
                f"--nnodes {self.nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node (a free port on "
                "the first node's host)"
            )
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise BadInput(f"--rdzv-endpoint {self.endpoint!r}: give HOST:PORT, e.g. node0.example:29400")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise BadInput(f"--node-rank {self.node_rank}: the nodes are numbered 0 to {self.nnodes - 1}")
        flags = [
            f"--nnodes={self.nnodes}",
            *local,
            f"--rdzv-backend={self.backend or 'c10d'}",
            f"--rdzv-endpoint={self.endpoint}",
        ]
        flags += [f"--rdzv-id={self.run_id}"] * (self.run_id is not None)
        return flags + [f"--node-rank={self.node_rank}"] * (self.node_rank is not None)


def launch(nproc: int, args: list[str], nodes: Nodes = Nodes()) -> int:
    """Run `lcsb ARGS` under torchrun's agent (in this process) with `nproc` local processes on this node of
    `nodes`; returns the exit code. A rank that failed has said why on its own stderr; one killed by a signal, a
    lost rendezvous and a signal to this process are one line here."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = parse_args([*nodes.torchrun_flags(nproc), "-m", "lcsb_cli", *args])
    try:
        run(config)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        raise LcsbError(
            f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; the other ranks stop; "
            "continue with --resume"
        ) from exc
    except RendezvousError as exc:
        raise LcsbError(
            f"this node lost the rendezvous at {config.rdzv_endpoint} ({_reason(exc)}): the node that hosts it "
            "stopped, or it never formed; continue with --resume on every node"
        ) from exc
    except SignalException as exc:
        # the agent passed the signal on: each rank checkpointed as one process does
        stop = signal.Signals(exc.sigval)
        print(f"stopped by {stop.name}; continue with --resume", file=sys.stderr)
        return {signal.SIGTERM: 0, signal.SIGINT: 130}.get(stop, 128 + stop.value)
    return 0
