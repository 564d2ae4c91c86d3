"""The products of one decoder layer's forward at the bench's shape, base against LoRA, each timed alone as the
bench's matmul probe times it (docs/RESULTS.md, issue 36: is peft's LoRA path, the rank-r products beside each
projection, where the step loses?).

    python scripts/lora_gemms.py recipes/bench-smollm2.yaml [KEY=VALUE ...] [--tokens 964] [--dtype bfloat16]

Shapes come from the recipe's model config and LoRA (`ModelShape.projections`); tokens default to the bench's batch,
4 x 241.
"""

from __future__ import annotations

import argparse

# lcsb_cli first: it sets OpenMP's wait policy, which libgomp reads when torch loads it
from lcsb_cli.bench.roofline import PROBE_DTYPES, ModelShape, best_call
from lcsb_cli.model.load import check_causal_lm, resolve_base_dir
from lcsb_cli.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tokens", type=int, default=964)
    parser.add_argument("--dtype", choices=sorted(PROBE_DTYPES), default="bfloat16")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    shape = ModelShape.of(check_causal_lm(base_dir, recipe.model.trust_remote_code), recipe)
    dtype, rank, seconds = PROBE_DTYPES[args.dtype], shape.lora_rank, 0.3
    print("| projection | base (us) | LoRA A (us) | LoRA B (us) |")
    print("| --- | --- | --- | --- |")
    base = lora = 0.0
    for name, (fan_in, fan_out) in shape.projections().items():
        times = [best_call(args.tokens, fan_in, fan_out, dtype, seconds)]
        if name in shape.lora_targets:
            times += [
                best_call(args.tokens, fan_in, rank, dtype, seconds),
                best_call(args.tokens, rank, fan_out, dtype, seconds),
            ]
        base, lora = base + times[0], lora + sum(times[1:])
        print(f"| {name} | " + " | ".join(f"{t * 1e6:.0f}" for t in times) + " |")
    qkv = sum(
        best_call(args.tokens, shape.projections()[n][0], rank, dtype, seconds) for n in ("q_proj", "k_proj", "v_proj")
    )
    fused = best_call(args.tokens, shape.hidden, 3 * rank, dtype, seconds)
    print(
        f"\nLoRA's products: {lora * 1e6:.0f} us against the base's {base * 1e6:.0f} ({lora / base:.0%}); q, k and "
        f"v's three A products, {qkv * 1e6:.0f} us, fused into one: {fused * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
