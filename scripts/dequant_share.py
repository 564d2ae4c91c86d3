"""What share of a training step the GGUF dequantization takes on a packed base (quantization gguf), in forward and
in backward, per method: a few steps of the engine's own Trainer for each, with every dequantization timed. lcsb's
backward reaches only the active block (and, with upper_path exact, the layers above it), so it dequantizes fewer
weights there: the paper's mechanism, on the file's own formats.

    python scripts/dequant_share.py recipes/bench-smollm2.yaml --steps 4 --compare full-backprop lcsb:4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lcsb_cli.methods import recipe_for_label
from lcsb_cli.model import packed
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer

SPENT = {"forward": 0.0, "backward": 0.0}
CALLS = {"forward": 0, "backward": 0}


def timed(dequantize):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        weight = dequantize(*args, **kwargs)
        # inside an autograd backward pass the engine has a graph task running
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        SPENT[phase] += time.perf_counter() - start
        CALLS[phase] += 1
        return weight

    return wrapper


def measure(recipe, steps: int, warmup: int) -> dict:
    trainer, _, _ = build_trainer(recipe)
    trainer.good.take()
    for step in range(warmup):
        trainer.step(step)
    for phase in SPENT:
        SPENT[phase], CALLS[phase] = 0.0, 0
    times = [trainer.step(step)["step_time_s"] for step in range(warmup, warmup + steps)]
    total = sum(times)
    return {
        "median_step_s": statistics.median(times),
        **{f"dequant_{phase}_share": SPENT[phase] / total for phase in SPENT},
        **{f"dequant_{phase}_ms_per_step": 1000 * SPENT[phase] / steps for phase in SPENT},
        **{f"{phase}_calls_per_step": CALLS[phase] / steps for phase in CALLS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--compare", nargs="+", default=["full-backprop", "lcsb:4"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    packed._weight = timed(packed._weight)
    base = load_recipe(args.recipe, ["quantization=gguf", *args.overrides])
    for label in args.compare:
        row = measure(recipe_for_label(label, base), args.steps, args.warmup)
        print(label, " ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
