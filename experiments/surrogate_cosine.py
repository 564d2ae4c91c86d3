"""LCSB's surrogate gradient against the true one on a recipe's model and data (docs/RESULTS.md, "Why it lags").

For each block of K and each exact window W (W layers above the active block backpropagate exactly, identity
beyond; W=0 is the paper's path), the cosine and norm ratio of the block's LoRA gradient against full backprop's,
on one batch of the recipe's training data. LoRA B starts at zero, which would leave A without gradient, so B is
drawn small (std `--b-std`) as after a few steps of training.

    python experiments/surrogate_cosine.py recipes/lamp2-smollm2.yaml --blocks 4 --windows 0 2 4 8 16 data.user=null
"""

from __future__ import annotations

import argparse
import json

import torch

from lcsb_cli.data import build_train_batches
from lcsb_cli.model.load import load_model
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.recipe import load_recipe
from lcsb_cli.selective import partition, surrogate_agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    parser.add_argument("--batches", type=int, default=1, help="batches averaged into the gradient")
    parser.add_argument("--b-std", type=float, default=1e-3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe, args.overrides)
    torch.manual_seed(recipe.train.seed)
    loaded = load_model(recipe, torch.device("cpu"))
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=args.b_std)
    stream = build_train_batches(recipe, loaded.tokenizer)
    batches = [stream.batch(i) for i in range(args.batches)]
    loaded.model.train()

    def loss() -> torch.Tensor:
        total = sum(causal_lm_loss(loaded.model, b) for b in batches)
        return total / sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)

    blocks = partition(len(loaded.layers), args.blocks)
    agreement = surrogate_agreement(loaded.layers, blocks, loss, args.windows)
    print(f"| block | {' | '.join(f'W={w}' for w in args.windows)} |")
    print("|---" * (len(args.windows) + 1) + "|")
    for block, layers in enumerate(blocks):
        cells = [f"{agreement[block, w][0]:.2f} ({agreement[block, w][1]:.2f})" for w in args.windows]
        print(f"| {block} (layers {layers.start}-{layers.stop - 1}) | {' | '.join(cells)} |")
    print("cells: cosine (surrogate norm / true norm)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {"block": b, "window": w, "cosine": c, "norm_ratio": r}
                    for (b, w), (c, r) in sorted(agreement.items())
                ],
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
