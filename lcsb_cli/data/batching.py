"""Padding and a resumable batch order: batch i depends only on (dataset, batch size, seed, i)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_EPOCH_STRIDE = 1_000_003
_CACHED_EPOCHS = 4


def collate(rows: list[dict], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad input_ids/labels to the longest row, rounded up to `multiple`; attention_mask 1 on real tokens,
    labels -100 on pads. Rounding (data.pad_to_multiple_of, as mlx-lm pads to 32) leaves a run few distinct batch
    shapes: fewer kernels compiled and cached, and a heap that is not fragmented anew by each length.

    Packed rows (data/packing.py) also give `position_ids`, restarting at 0 with each document; the pads of a row
    count from 0 again, so they read as one more document, which no real token attends to."""
    width = -(-max(len(row["input_ids"]) for row in rows) // multiple) * multiple
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    packed = "position_ids" in rows[0]
    position_ids = torch.arange(width).repeat(len(rows), 1)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(row["labels"], dtype=torch.long)
        if packed:
            position_ids[i, :n] = torch.tensor(row["position_ids"], dtype=torch.long)
            position_ids[i, n:] = torch.arange(width - n)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {**batch, "position_ids": position_ids} if packed else batch


class BatchStream:
    """Micro-batches from the endless concatenation of per-epoch permutations.

    Epoch e is ordered by torch.randperm with seed ``seed * 1_000_003 + e``; batch i holds positions
    [i*B, i*B + B) of that endless sequence, so every batch is full (it may straddle two epochs) and
    a resumed run only needs the batch index to continue exactly. Sharded over W ranks, global batch i is
    [i*B*W, (i+1)*B*W) and rank r takes its r-th B: together the ranks see what one process with batch B*W sees.
    """

    def __init__(
        self,
        dataset: Sequence[dict] | Any,
        batch_size: int,
        seed: int,
        pad_id: int,
        shard: tuple[int, int] = (0, 1),
        collate_fn: Callable[[list[dict], int], dict] = collate,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("cannot batch an empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.collate_fn = collate_fn
        self.rank, self.world_size = shard
        self._perms: dict[int, list[int]] = {}

    @property
    def batches_per_epoch(self) -> float:
        return len(self.dataset) / self.batch_size

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) >= _CACHED_EPOCHS:
                del self._perms[next(iter(self._perms))]
            gen = torch.Generator().manual_seed(self.seed * _EPOCH_STRIDE + epoch)
            self._perms[epoch] = torch.randperm(len(self.dataset), generator=gen).tolist()
        return self._perms[epoch]

    def indices(self, index: int) -> list[int]:
        """Dataset row indices of micro-batch ``index``."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        n = len(self.dataset)
        start = (index * self.world_size + self.rank) * self.batch_size
        positions = range(start, start + self.batch_size)
        return [self._perm(p // n)[p % n] for p in positions]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        return self.collate_fn([self.dataset[i] for i in self.indices(index)], self.pad_id)
