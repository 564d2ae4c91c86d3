"""data.packing's figures (issue 37): each shipped sample trained unpacked and packed for the same number of epochs.

On the completion sample (recipes/data/qa), the chat sample (recipes/data/chat) and the text sample (training on
recipes/data/text/train.txt, held out on eval.txt), the shipped recipe (qa-, chat-, text-smollm2.yaml) is run
three ways for `--epochs` passes over its training rows, warmup a tenth of the steps, nothing else changed but the
model: `data.packing=false`; `=true` with the recipe's batch size (packed rows are fewer, so fewer steps); and
`=true` with the batch size scaled by packed rows / rows, so that it takes about as many steps, each of about as
many documents, as unpacked (the held-out loss to compare). Reported per run: training rows, batch size and steps,
tokens/s (real tokens over the summed step times), the share of padding (padded positions over all positions of
the batches trained on), wall time, and the held-out loss after training (evaluated unpacked every way, so they
compare), beside the untrained model's.

Text is windowed either way: unpacked, its documents run back to back through max_length windows with attention
across them (run_clm's packing, so next to no padding); packed, the same tokens go in as documents kept apart.

    python scripts/packing_figures.py --model tiny-qwen2 --epochs 2
    python scripts/packing_figures.py --model smollm2-135m --epochs 1 --examples 64

Timings are wall-clock on whatever else the machine runs: compare the ways of one table, run back to back.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from lcsb_cli.data import build_train_batches, load_task, token_rows
from lcsb_cli.data.packing import padding_share
from lcsb_cli.evaluate.text import held_out_loss
from lcsb_cli.model.load import load_model
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import train
from lcsb_cli.run.hooks import SilentReporter
from lcsb_cli.run.rundir import read_metrics

REPO = Path(__file__).resolve().parent.parent
SAMPLES = {
    "completion": ("qa-smollm2.yaml", "qa/train.jsonl"),
    "chat": ("chat-smollm2.yaml", "chat/train.jsonl"),
    "text": ("text-smollm2.yaml", "text/train.txt"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen2", help="model.name for every run (a preset or a local dir)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--examples", type=int, default=0, help="train on the first N examples (0: all)")
    parser.add_argument("--samples", nargs="+", default=list(SAMPLES), choices=list(SAMPLES))
    parser.add_argument("--output", type=Path, default=REPO / "runs" / "packing-figures")
    parser.add_argument("--padding-only", action="store_true", help="rows, steps and padding; no training")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    results = []
    for sample in args.samples:
        unpacked, recipe = measure(sample, False, args)
        packed, _ = measure(sample, True, args)
        # as many steps as unpacked: the batch holds as many documents
        scale = packed["train_rows"] / unpacked["train_rows"]
        scaled, _ = measure(sample, True, args, max(1, round(recipe.train.batch_size * scale)))
        # the untrained model's: the same every way
        before = {} if args.padding_only else {"held_out_loss_before": held_out(recipe, None)}
        for row in (unpacked, packed, scaled):
            results.append({**row, **before})
            print(json.dumps(results[-1]), flush=True)
    (args.output / "packing.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results, args)
    (args.output / "packing.md").write_text(table)
    print(table)


def recipe_for(sample: str, packing: bool, args, train_file: Path, steps: int, batch_size: int | None):
    name, _ = SAMPLES[sample]
    return load_recipe(
        REPO / "recipes" / name,
        [
            *([f"train.batch_size={batch_size}"] if batch_size else []),
            f"model.name={args.model}",
            f"data.train={train_file}",
            f"data.packing={str(packing).lower()}",
            f"train.max_steps={steps}",
            f"train.warmup_steps={max(1, steps // 10)}",
            f"train.save_every={steps}",
            "train.eval_every=0",
            "train.log_every=1",
        ],
    )


def measure(sample: str, packing: bool, args, batch_size: int | None = None) -> tuple[dict, object]:
    """One run's figures, and its recipe (`batch_size`: instead of the recipe's)."""
    train_file = sliced(sample, args.examples, args.output)
    probe = recipe_for(sample, packing, args, train_file, 1, batch_size)
    loaded = load_model(probe, torch.device("cpu"))
    stream = build_train_batches(probe, loaded.tokenizer)
    steps = max(1, math.ceil(args.epochs * len(stream.dataset) / probe.train.batch_size))
    recipe = recipe_for(sample, packing, args, train_file, steps, batch_size)
    figures = {
        "sample": sample,
        "packing": packing,
        "batch_size": recipe.train.batch_size,
        "train_rows": len(stream.dataset),
        "steps": steps,
        "padding_share": padding_share(stream.batch(i) for i in range(steps)),
    }
    if args.padding_only:
        return figures, recipe
    run_dir = args.output / f"{sample}-{'packed' if packing else 'unpacked'}-b{recipe.train.batch_size}"
    summary = train(recipe, run_dir, SilentReporter(), force=True)
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "tokens" in row]
    return {
        **figures,
        "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows),
        "wall_time_s": summary["wall_time_s"],
        "final_train_loss": summary["final_loss"],
        "held_out_loss": held_out(recipe, run_dir / "adapter"),
    }, recipe


def held_out(recipe, adapter: Path | None) -> float:
    """Mean loss per target token of the held-out items, unpacked (the base model when `adapter` is None)."""
    loaded = load_model(recipe, torch.device("cpu"), adapter)
    rows = token_rows(recipe, loaded.tokenizer, load_task(recipe, loaded.tokenizer).held_out)
    return held_out_loss(loaded.model, rows, loaded.tokenizer.pad_token_id, recipe.eval.batch_size)["loss"]


def sliced(sample: str, examples: int, output: Path) -> Path:
    """The sample's training file, or its first `examples` examples (lines; paragraphs of a .txt) in a copy."""
    source = REPO / "recipes" / "data" / SAMPLES[sample][1]
    if not examples:
        return source
    text = source.read_text()
    sep = "\n\n" if source.suffix == ".txt" else "\n"
    items = [item for item in text.split(sep) if item.strip()][:examples]
    target = Path(tempfile.mkdtemp(dir=output)) / source.name
    target.write_text(sep.join(items) + "\n")
    return target


def markdown(results: list[dict], args) -> str:
    trained = not args.padding_only
    columns = ["sample", "packing", "rows", "batch", "steps", "padding"]
    columns += ["tokens/s", "wall s", "held-out loss (untrained)"] if trained else []
    lines = [
        f"model {args.model}, {args.epochs:g} epochs, "
        + (f"the first {args.examples} training examples" if args.examples else "every training example"),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in results:
        cells = [r["sample"], "yes" if r["packing"] else "no", r["train_rows"], r["batch_size"], r["steps"]]
        cells.append(f"{100 * r['padding_share']:.1f}%")
        if trained:
            cells += [f"{r['tokens_per_s']:.0f}", f"{r['wall_time_s']:.0f}"]
            cells.append(f"{r['held_out_loss']:.3f} ({r['held_out_loss_before']:.3f})")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
