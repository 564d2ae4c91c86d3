"""Where a training step's CPU time goes: a few steps of the engine's own Trainer (lcsb K=4, bf16 weights by
default) under torch.profiler, each op's self time grouped into GEMMs (by shape family, with their GFLOP/s),
attention (SDPA), elementwise / norm / activations, softmax / loss, copies / casts, other ops, and Python / other
overhead: the step time minus the time inside profiled ops; then the dtype casts a step makes (aten::_to_copy), of
frozen weights and of everything else, counted in one more step. `--plain` profiles without shapes and FLOPs, which
double a step, and prints the profiler's operator table alone.

    python tools/measure/profile_step.py recipes/bench-smollm2.yaml --steps 2 --warmup 1 train.batch_size=8
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

# lcsb_cli first: it sets OpenMP's wait policy, which libgomp reads when torch loads it
from lcsb_cli.model.precision import CastCounter
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer

# isort: split
from torch.profiler import ProfilerActivity, profile

DEFAULTS = ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=identity", "model.dtype=bfloat16"]
GEMM = {"aten::mm", "aten::addmm", "aten::bmm"}
# their self time is dispatch; the product is the mm inside
GEMM_WRAPPERS = {"aten::linear", "aten::matmul"}
# the first pattern an op's name matches names its group
CATEGORIES = [
    ("attention (sdpa)", r"scaled_dot_product|flash_attention|_efficient_attention"),
    ("softmax / loss", r"softmax|logsumexp|cross_entropy|nll_loss|ChunkedHeadCrossEntropy"),
    ("copies / casts", r"aten::(copy_|to|_to_copy|contiguous|clone)$"),
    (
        "elementwise / norm / activations",
        (
            r"aten::(add|sub|mul|div|neg|pow|rsqrt|sqrt|mean|sum|silu|sigmoid|exp|log|"
            r"where|cat|masked_fill|fill|zero|addcmul|addcdiv|lerp|clamp|eq|ne|lt|gt|"
            r"ge|le|linalg_vector_norm|_foreach_\w+|\w+_backward)_?$"
        ),
    ),
]


def family(shapes: list[list[int]], model) -> str:
    """A GEMM's shape family from its operands' dimensions: LoRA (rank r), MLP, k/v, q/o, or the LM head."""
    config, rank = model.config, model.peft_config["default"].r
    dims = {d for shape in shapes for d in shape}
    kv = config.num_key_value_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    if rank in dims:
        return f"LoRA (r={rank})"
    if config.intermediate_size in dims:
        return f"MLP gate/up/down ({config.hidden_size}x{config.intermediate_size})"
    if kv in dims and kv != config.hidden_size:
        return f"k/v ({config.hidden_size}x{kv})"
    # targets x hidden x slice rows; the q/o products have only tokens and hidden
    if len(dims) > 2:
        return "LM head (vocabulary slices)"
    return f"q/o ({config.hidden_size}x{config.hidden_size})"


def in_backward(event) -> bool:
    """Whether a profiled op ran inside the autograd engine (its backward), from its parent chain."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return True
        event = event.cpu_parent
    return False


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if re.search(pattern, name)), "other ops")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/bench-smollm2.yaml")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides (after the lcsb K=4 bf16 defaults)")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before profiling")
    parser.add_argument(
        "--plain", action="store_true", help="no shapes or FLOPs (which double the step): the profiler's op table only"
    )
    args = parser.parse_intermixed_args()
    recipe = load_recipe(args.recipe, [*DEFAULTS, *args.overrides])
    trainer, loaded, _ = build_trainer(recipe)
    trainer.begin()
    for step in range(args.warmup):
        trainer.step(step)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=not args.plain, with_flops=not args.plain) as prof:
        rows = [trainer.step(step) for step in range(args.warmup, args.warmup + args.steps)]
    if args.plain:
        print("steps", " ".join(f"{row['step_time_s']:.2f}" for row in rows), "s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    step_ms = sum(row["step_time_s"] for row in rows) * 1e3 / args.steps
    groups, gemms = defaultdict(float), defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        ms = event.self_cpu_time_total / 1e3 / args.steps
        if event.name in GEMM or event.name in GEMM_WRAPPERS:
            pass_ = "backward" if in_backward(event) else "forward"
            shapes = [s for s in event.input_shapes if s]
            fam = gemms[
                "linear / matmul dispatch"
                if event.name in GEMM_WRAPPERS
                else f"{family(shapes, loaded.model)}, {pass_}"
            ]
            fam[0] += ms
            fam[1] += (event.flops or 0) / args.steps
            groups["GEMMs"] += ms
        else:
            groups[category(event.name)] += ms
    groups["Python / other overhead"] = step_ms - sum(groups.values())
    print(
        f"{recipe.model.name} {recipe.method} K={recipe.lcsb.blocks} {recipe.lcsb.upper_path}, {recipe.model.dtype} "
        f"weights, autocast {recipe.train.autocast}, batch {recipe.train.batch_size}; {args.steps} profiled steps, "
        f"median {statistics.median(r['step_time_s'] for r in rows):.2f} s; blocks "
        f"{[r['active_block'] for r in rows]}; tokens {[r['tokens'] for r in rows]}"
    )
    print(f"{'group':<48}{'ms/step':>10}{'share':>8}{'GFLOP/s':>10}")
    for label, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{label:<48}{ms:>10.1f}{ms / step_ms:>8.1%}")
        if label == "GEMMs":
            for name, (fam_ms, flops) in sorted(gemms.items(), key=lambda kv: -kv[1][0]):
                rate = f"{flops / fam_ms / 1e6:>10.1f}" if fam_ms and flops else ""
                print(f"  {name:<46}{fam_ms:>10.1f}{fam_ms / step_ms:>8.1%}{rate}")
    print(f"{'step':<48}{step_ms:>10.1f}")
    with CastCounter(loaded.model) as casts:
        trainer.step(args.warmup + args.steps)
    for kind, (count, size) in casts.counts.items():
        print(f"dtype casts of {kind} in one more step: {count}, {size / 2**20:.0f} MiB read")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
