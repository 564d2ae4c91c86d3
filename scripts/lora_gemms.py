"""The bf16 products of one decoder layer's forward at the bench's shape, base against LoRA, timed one at a time
(docs/RESULTS.md, issue 36: is peft's LoRA path, r=16 products beside each projection, where the step loses?).

    python scripts/lora_gemms.py [--tokens 964] [--rank 16]

Shapes are SmolLM2-135M's (hidden 576, 3 kv heads of 64, MLP 1536); tokens = batch 4 x 241, the bench's batch.
"""

from __future__ import annotations

import argparse
import time

# lcsb_cli first: it sets OpenMP's wait policy, which libgomp reads when torch loads it
import lcsb_cli  # noqa: F401

# isort: split
import torch

PROJECTIONS = {
    "q": (576, 576),
    "k": (576, 192),
    "v": (576, 192),
    "o": (576, 576),
    "gate": (576, 1536),
    "up": (576, 1536),
    "down": (1536, 576),
}


def microseconds(x: torch.Tensor, weight: torch.Tensor, repeats: int = 200) -> float:
    """One product x @ weight.T, as nn.Linear computes it, timed after a warm-up."""
    for _ in range(20):
        x @ weight.t()
    start = time.perf_counter()
    for _ in range(repeats):
        x @ weight.t()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=964)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    bf16 = {"dtype": torch.bfloat16}
    base = lora = 0.0
    print("| projection | base (us) | LoRA A (us) | LoRA B (us) |")
    print("| --- | --- | --- | --- |")
    for name, (n_in, n_out) in PROJECTIONS.items():
        x, w = torch.randn(args.tokens, n_in, **bf16), torch.randn(n_out, n_in, **bf16)
        a, b = torch.randn(args.rank, n_in, **bf16), torch.randn(n_out, args.rank, **bf16)
        h = x @ a.t()
        times = [microseconds(x, w), microseconds(x, a), microseconds(h, b)]
        base, lora = base + times[0], lora + times[1] + times[2]
        print(f"| {name} | " + " | ".join(f"{t:.0f}" for t in times) + " |")
    x = torch.randn(args.tokens, 576, **bf16)
    fused = microseconds(x, torch.randn(3 * args.rank, 576, **bf16))
    print(
        f"\nLoRA's products: {lora:.0f} us against the base's {base:.0f} ({lora / base:.0%}); "
        f"q, k and v's three A products fused into one: {fused:.0f} us"
    )


if __name__ == "__main__":
    main()
