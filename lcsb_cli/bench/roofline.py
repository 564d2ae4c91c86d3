"""The training step against this machine's matmul limit.

A step's model FLOPs are counted from the shapes (MFU convention): the matrix products a step needs, forward and
backward, and nothing that activation checkpointing or the chunked LM-head loss recompute in backward; norms, RoPE,
activations and the optimizer are left out. A short probe measures fp32 and bf16 GEMM throughput at the model's own
projection shapes, in the worker's process and threads, and each method's GFLOP/s is compared with the limit of the
dtype it computes in.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..host import host_kind
from ..methods import METHODS, Plan
from ..model.shape import LayerShape
from ..recipe import Recipe, resolved_autocast
from ..recipe.schema import ALL_LINEAR

QKV = ("q_proj", "k_proj", "v_proj")
# the decoder layer's linear layers: what lora.targets' all-linear adapts in the families this shape describes
PROJECTIONS = (*QKV, "o_proj", "gate_proj", "up_proj", "down_proj")
PROBE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape(LayerShape):
    layers: int
    vocab: int
    lora_rank: int
    lora_targets: tuple[str, ...]

    @classmethod
    def of(cls, config, recipe: Recipe) -> ModelShape:
        """The decoder layer's shape, the layer count and vocabulary, and the recipe's LoRA."""
        return cls(
            **vars(LayerShape.of(config)),
            layers=config.num_hidden_layers,
            vocab=config.vocab_size,
            lora_rank=recipe.lora.rank,
            lora_targets=PROJECTIONS if recipe.lora.targets == [ALL_LINEAR] else tuple(recipe.lora.targets),
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def plan_for(recipe: Recipe, layers: int) -> Plan:
    """The recipe's method's plan (methods.py): what its backward differentiates, per layer."""
    return METHODS[recipe.method].plan(recipe, layers)


class StepFlops:
    """Model FLOPs of a training step from its micro-batches' padded shapes.

    Per decoder layer and token: each projection's 2*in*out, and each LoRA adapter's 2*r*(in + out); attention
    scores and values 2 * 2 * B * heads * S^2 * head_dim, counted over the full S x S, causal or not (a padded
    batch hands SDPA an explicit mask, with which it computes every score). The LM head 2 * hidden * vocab per
    position it runs on: the engine's loss applies it to the target positions only, a plain transformers model
    (`full_logits`) to all.
    Backward, with the base weights frozen: each projection's input gradient (1x its forward) and attention's two
    operand gradients (2x its forward) in every layer backward runs through, except the lowest layer's q/k/v
    input gradients; the LoRA's rank-r gradient everywhere there and its input gradient where the layer's is
    needed; LoRA weight gradients (1x the adapter's forward) in trained layers; the LM head's input gradient.
    """

    def __init__(self, shape: ModelShape, plan: Plan, full_logits: bool = False):
        self.shape, self.plan, self.full_logits = shape, plan, full_logits
        self.projections = shape.projections()

    def step(self, batches: list[dict[str, torch.Tensor]]) -> float:
        return sum(self.micro_batch(*b["input_ids"].shape, self._head_rows(b)) for b in batches)

    def _head_rows(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel() if self.full_logits else int((batch["labels"][:, 1:] != -100).sum())

    def micro_batch(self, batch: int, length: int, head_rows: int) -> float:
        shape, plan, tokens = self.shape, self.plan, batch * length
        base, lora_out, lora_in = self._products(tokens, self.projections)
        base_qkv, _, lora_in_qkv = self._products(tokens, QKV)
        attention = 4 * batch * shape.heads * length**2 * shape.head_dim
        head = 2 * head_rows * shape.hidden * shape.vocab
        forward = shape.layers * (base + lora_out + lora_in + attention) + head
        backward = sum(
            through * (base + lora_out + lora_in + 2 * attention)
            - lowest * (base_qkv + lora_in_qkv)
            + trained * (lora_out + lora_in)
            for through, lowest, trained in zip(plan.through, plan.lowest, plan.trained)
        )
        return plan.forwards * forward + (backward + head if any(plan.through) else 0.0)

    def _products(self, tokens: int, names) -> tuple[int, int, int]:
        """2*M*N*K summed over the projections `names`: the base products, the adapters' B sides (r -> out) and
        their A sides (in -> r)."""
        base = lora_out = lora_in = 0
        for name in names:
            fan_in, fan_out = self.projections[name]
            base += 2 * tokens * fan_in * fan_out
            if name in self.shape.lora_targets:
                lora_out += 2 * tokens * self.shape.lora_rank * fan_out
                lora_in += 2 * tokens * self.shape.lora_rank * fan_in
        return base, lora_out, lora_in


def compute_dtype(recipe: Recipe, trainer_bf16: bool = False) -> str:
    """bfloat16 when the frozen products run in bf16: bf16 weights, bf16 autocast or hf-trainer's bf16=True
    (`trainer_bf16`)."""
    bf16 = recipe.model.dtype == "bfloat16" or resolved_autocast(recipe) == "bf16" or trainer_bf16
    return "bfloat16" if bf16 else "float32"


def probe_matmul(shape: ModelShape, tokens: int, seconds: float = 0.5) -> dict:
    """GFLOP/s of fp32 and bf16 GEMMs at the decoder layer's projection shapes (tokens x in @ in x out, as
    nn.Linear's forward runs them), each distinct shape timed for about `seconds` and its best call kept, combined
    over the layer's mix of projections: the limit each method's achieved GFLOP/s is compared with. Where a kernel
    runs backward's input-gradient layout (grad @ W) slower, that shows as a lower fraction."""
    counts = Counter(shape.projections().values())
    limits = {}
    for name, dtype in PROBE_DTYPES.items():
        best = {pair: best_call(tokens, *pair, dtype, seconds / len(counts)) for pair in counts}
        flops = sum(n * 2 * tokens * fan_in * fan_out for (fan_in, fan_out), n in counts.items())
        limits[name] = flops / sum(n * best[pair] for pair, n in counts.items()) / 1e9
    return {
        "matmul_limit_gflops": limits,
        "matmul_probe": {
            "shapes": [[tokens, fan_in, fan_out] for fan_in, fan_out in counts],
            "threads": torch.get_num_threads(),
            "host": host_kind(),
        },
    }


def best_call(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype, seconds: float) -> float:
    """The fastest of at least two calls (the first pays oneDNN's set-up), repeated while under `seconds`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=generator).to(dtype)
    weight = torch.randn(fan_out, fan_in, generator=generator).to(dtype)
    times, started = [], time.perf_counter()
    while len(times) < 2 or time.perf_counter() - started < seconds:
        mark = time.perf_counter()
        F.linear(x, weight)
        times.append(time.perf_counter() - mark)
    return min(times)


def roofline_fields(rows: list[dict], median_step_s: float, limit_gflops: float | None) -> dict:
    """A method's mean model GFLOP per timed step, that over its median step time, and that as a share of the
    limit; nothing without a limit or when its rows carry no FLOP count."""
    if not limit_gflops or not rows or any("model_flops" not in r for r in rows):
        return {}
    per_step = statistics.fmean(r["model_flops"] for r in rows) / 1e9
    achieved = per_step / median_step_s
    return {"model_gflop_per_step": per_step, "achieved_gflops": achieved, "roofline_fraction": achieved / limit_gflops}
