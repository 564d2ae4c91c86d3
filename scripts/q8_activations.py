"""Should training mimic llama.cpp's activation quantization? llama.cpp's CPU dot products against Q4/Q5/Q6/Q8 blocks
quantize the activations to 8 bits per block of 32 (Q8_0 / Q8_1 / Q8_K: scale max|x| / 127, round to nearest)
first. This measures how far lcsb's packed forward (exact float activations) is from llama.cpp's logits on the same
file, and how far it is when every packed product's input is rounded that way too.

    python scripts/q8_activations.py smollm2-135m
    python scripts/q8_activations.py gemma3-270m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lcsb_cli.model import packed
from lcsb_cli.model.llama_cpp import LlamaCpp
from lcsb_cli.model.load import gguf_source, load_model
from lcsb_cli.recipe import load_recipe

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "lamp2-smollm2.yaml"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, a little robot",
    "Which tag does this movie relate to among the following tags? tags: [comedy, action, classic]",
]


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp quantizes activations: per block of 32 along the last dimension, scale max|x| / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale == 0, 1, scale)) * scale).reshape(x.shape)


def distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b| over the largest |logit|, RMS of a - b over the RMS of b)."""
    return ((a - b).abs().max() / b.abs().max()).item(), ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", default="smollm2-135m")
    args = parser.parse_args()
    recipe = load_recipe(RECIPE, [f"model.name={args.preset}", "quantization=gguf", "data.user=null"])
    model = load_model(recipe, torch.device("cpu")).model.eval()
    exact_forward = packed.PackedLinear.forward
    with LlamaCpp(gguf_source(args.preset)) as cpp:
        for prompt in PROMPTS:
            ids = cpp.tokenize(prompt)
            reference = torch.from_numpy(cpp.logits(ids))
            rows = {}
            for name, forward in (("exact", exact_forward), ("q8", lambda self, x: exact_forward(self, q8_blocks(x)))):
                packed.PackedLinear.forward = forward
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                rows[name] = (*distance(logits, reference), (logits.argmax(-1) == reference.argmax(-1)).float().mean())
            packed.PackedLinear.forward = exact_forward
            print(
                f"{len(ids):3d} tokens  "
                + "  ".join(f"{k}: max {m:.4f} rms {r:.4f} argmax-agree {a:.3f}" for k, (m, r, a) in rows.items())
            )


if __name__ == "__main__":
    main()
