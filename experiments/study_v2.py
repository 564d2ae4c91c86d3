"""The LCSB study, version 2 (docs/RESULTS.md): every method at a grid of constant rates for a few epochs, held-out
loss along each run, the rate chosen on a validation split carved from the training data.

    python experiments/study_v2.py run OUT --task lamp2 [--rates 3e-4 1e-3 3e-3] [--methods NAME ...] [--epochs 3]
        [--train-size 120] [--seed 0] [--base fp32|nf4|gguf]
    python experiments/study_v2.py report OUT [--times BENCH_JSON]      # OUT/report.md and OUT/TASK-BASE-time.png
    python experiments/study_v2.py spare OUT --task lamp2 [--methods NAME ...]   # chosen runs on the unused examples
    python experiments/study_v2.py moves OUT --task lamp2 --rate 1e-3 [--methods NAME ...]  # how far each block moved
    python experiments/study_v2.py seeds OUT OUT_SEED1 ... --task lamp2 [--times BENCH_JSON] [--ckpt-speedup 1.28]
        # a method against full backprop over seeds at the rates the first OUT's validation chose

`run` skips runs that already finished, so an interrupted study continues. Every number comes from `lcsb train` and
`lcsb eval`. `--times` takes step times from one interleaved `lcsb bench` (its methods' labels as below) instead of
each run's own, which a busy machine distorts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPES = {task: Path(__file__).resolve().parent / "recipes" / f"{task}.yaml" for task in ("lamp2", "qa", "text")}
DATA = REPO / "recipes" / "data"
BASES = {"fp32": [], "nf4": ["quantization=nf4"], "gguf": ["quantization=gguf"]}
EXACT = ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=exact"]
SUFFIX = ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=suffix"]
# name (a bench label where one exists; the names of the dials' runs predate lcsb.experimental) -> recipe overrides
METHODS = {
    "full-backprop": ["method=full-backprop"],
    "lcsb:4": ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=identity"],
    "lcsb:4:exact": EXACT,
    "lcsb:4:suffix": SUFFIX,
    "lcsb:4:suffix@lcsb.lr_scale=sqrt_k": [*SUFFIX, "lcsb.experimental.lr_scale=sqrt_k"],
    "lcsb:4:suffix@lcsb.switch_every=4": [*SUFFIX, "lcsb.experimental.switch_every=4"],
    "lcsb:4:suffix@lcsb.switch_every=4,lcsb.on_return=reset": [
        *SUFFIX,
        "lcsb.experimental.switch_every=4",
        "lcsb.experimental.on_return=reset",
    ],
    "lcsb:4:exact@lcsb.lr_scale=sqrt_k": [*EXACT, "lcsb.experimental.lr_scale=sqrt_k"],
    "lcsb:4:exact@lcsb.switch_every=4": [*EXACT, "lcsb.experimental.switch_every=4"],
    "lcsb:4:exact@lcsb.switch_every=4,lcsb.on_return=reset": [
        *EXACT,
        "lcsb.experimental.switch_every=4",
        "lcsb.experimental.on_return=reset",
    ],
    "freeze": ["method=freeze", "freeze.layers=8"],
    "lisa": ["method=lisa", "lisa.layers=8", "lisa.interval=4"],
}


def split_data(task: str, out: Path, train_size: int) -> tuple[dict[str, list[str]], int]:
    """Every 5th training example goes to the validation split, the next `train_size` others train, the rest are
    spare (never trained on, a second held-out set); the task's own held-out set stays as the recipe names it.
    -> ({"train" | "val" | "spare": overrides}, training rows), where plain text counts its 256-token rows at about 4
    characters a token."""
    out.mkdir(parents=True, exist_ok=True)
    if task == "lamp2":
        questions = json.loads((DATA / "lamp2" / "train_questions.json").read_text())
        golds = {g["id"]: g for g in json.loads((DATA / "lamp2" / "train_outputs.json").read_text())["golds"]}
        parts = three_parts(questions, train_size)
        overrides = {}
        for name, items in parts.items():
            (out / f"{name}_questions.json").write_text(json.dumps(items))
            labels = {"task": "LaMP_2", "golds": [golds[q["id"]] for q in items]}
            (out / f"{name}_outputs.json").write_text(json.dumps(labels))
            key = "train" if name == "train" else "eval"
            files = (out / f"{name}_questions.json", out / f"{name}_outputs.json")
            overrides[name] = [f"data.{key}={files[0]}", f"data.{key}_labels={files[1]}"]
        return overrides, len(parts["train"])
    source = DATA / ("qa/train.jsonl" if task == "qa" else "text/train.txt")
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    parts = three_parts(lines, train_size)
    for name, items in parts.items():
        (out / f"{name}{source.suffix}").write_text("\n".join(items) + "\n")
    rows = len(parts["train"]) if task == "qa" else sum(map(len, parts["train"])) // (4 * 256)
    keys = {"train": "train", "val": "eval", "spare": "eval"}
    overrides = {name: [f"data.{keys[name]}={out / f'{name}{source.suffix}'}"] for name in parts}
    return overrides, rows


def three_parts(items: list, train_size: int) -> dict[str, list]:
    rest = [item for i, item in enumerate(items) if i % 5]
    return {"val": items[::5], "train": rest[:train_size], "spare": rest[train_size:]}


def run_dir_name(method: str) -> str:
    return method.replace(":", "_").replace("@", "+").replace(",", "+")


def lcsb(*args: str) -> int:
    """Exit code 3 (diverged, divergence.action=stop) is a result, any other failure stops the study."""
    code = subprocess.run([sys.executable, "-m", "lcsb_cli", *args], cwd=REPO, stdout=subprocess.DEVNULL).returncode
    if code not in (0, 3):
        raise SystemExit(f"lcsb {' '.join(args)} exited {code}")
    return code


def run_grid(args) -> None:
    out = Path(args.out) / f"{args.task}-{args.base}"
    data, examples = split_data(args.task, out / "data", args.train_size)
    batch = 8 if args.task != "text" else 2
    steps = args.epochs * examples // batch
    every = max(1, steps // 9)
    print(f"{args.task}/{args.base}: {examples} training examples, {steps} steps of {batch}, held-out every {every}")
    for name in args.methods:
        for rate in args.rates:
            run = out / run_dir_name(name) / f"lr-{rate}"
            if (run / "val" / "eval.json").is_file():
                continue
            common = [*BASES[args.base], f"train.seed={args.seed}", f"train.batch_size={batch}"]
            diverged = lcsb(
                "train",
                str(RECIPES[args.task]),
                "--output",
                str(run),
                "--force",
                *common,
                *METHODS[name],
                *data["train"],
                f"train.max_steps={steps}",
                f"train.lr={rate}",
                "train.lr_scheduler=constant",
                "train.warmup_steps=3",
                f"train.eval_every={every}",
                "train.eval_metrics=loss",
                "train.save_every=0",
                "divergence.action=stop",
            )
            if diverged == 3:
                (run / "val").mkdir(exist_ok=True)
                (run / "val" / "eval.json").write_text(json.dumps({"loss": float("inf")}))
            else:
                lcsb("eval", str(run), "--output", str(run / "val"), *data["val"])
            print(f"  {name} lr {rate}: done", flush=True)


def read_run(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    steps = [r for r in rows if "step_time_s" in r]
    last_eval = [r for r in rows if "eval_loss" in r][-1]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "curve": held,
        "final": held[-1][1],
        "best": min(loss for _, loss in held),
        "val": json.loads((run / "val" / "eval.json").read_text())["loss"],
        "step_time_s": statistics.median(r["step_time_s"] for r in steps),
        "peak_mem_mb": summary["peak_mem_mb"],
        "diverged": summary["diverged"],
        "accuracy": last_eval.get("eval_accuracy"),
    }


def finished(study: Path, method: str) -> dict[float, Path]:
    """rate -> run dir, for the method's runs that finished (validated)."""
    runs = (study / run_dir_name(method)).glob("lr-*")
    return {float(run.name[3:]): run for run in runs if (run / "val" / "eval.json").is_file()}


def spare(args) -> None:
    """Each method's run at its chosen rate (lowest validation loss) evaluated once more, on the spare training
    examples (never trained on): a second, larger held-out set for the final comparison."""
    study = Path(args.out) / f"{args.task}-{args.base}"
    with tempfile.TemporaryDirectory() as scratch:
        split_data(args.task, Path(scratch), args.train_size)
        for path in (study / "data").glob("train*"):
            if path.read_bytes() != (Path(scratch) / path.name).read_bytes():
                raise SystemExit(f"{study}: its runs trained on another split than --train-size {args.train_size}")
    data, _ = split_data(args.task, study / "data", args.train_size)
    print("| method | rate | held-out final | spare: loss | spare: accuracy or exact match | spare: n |")
    print("|" + " --- |" * 6)
    for name in args.methods:
        run = chosen_run(study, name)
        if run is None:
            continue
        if not (run / "spare" / "eval.json").is_file():
            lcsb("eval", str(run), "--output", str(run / "spare"), *data["spare"])
        result = json.loads((run / "spare" / "eval.json").read_text())
        score = result.get("accuracy", result.get("exact_match"))
        cells = [name, run.name.removeprefix("lr-"), f"{read_run(run)['final']:.3f}", f"{result['loss']:.3f}"]
        cells += ["" if score is None else f"{score:.3f}", str(result["n"])]
        print("| " + " | ".join(cells) + " |")


def moves(args) -> None:
    """How far each block's LoRA moved (`block_moves`), each method's run at one rate, and its ratio to full
    backprop's."""
    study = Path(args.out) / f"{args.task}-{args.base}"
    runs = {name: finished(study, name).get(float(args.rate)) for name in args.methods}
    norms = {name: block_moves(run) for name, run in runs.items() if run is not None}
    full = norms.get("full-backprop")
    print("| method | rate | block 1 (bottom) | block 2 | block 3 | block 4 (top) |")
    print("|" + " --- |" * 6)
    for name, blocks in norms.items():
        shown = full and name != "full-backprop"
        cells = [f"{n:.2f}" + (f" ({n / f:.2f}x)" if shown else "") for n, f in zip(blocks, full or blocks)]
        print(f"| {name} | {args.rate} | " + " | ".join(cells) + " |")


def block_moves(run: Path, num_blocks: int = 4) -> list[float]:
    """The norm of the run's adapter update, scale * B @ A, over each block's layers (blocks as `lcsb.blocks`
    splits them)."""
    from safetensors.torch import load_file

    from lcsb_cli.selective import partition

    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    weights = load_file(run / "adapter" / "adapter_model.safetensors")
    squares: dict[int, float] = {}
    for key, a in weights.items():
        if ".lora_A." in key:
            layer = int(key.split(".layers.")[1].split(".")[0])
            delta = config["lora_alpha"] / config["r"] * weights[key.replace(".lora_A.", ".lora_B.")] @ a
            squares[layer] = squares.get(layer, 0.0) + delta.pow(2).sum().item()
    blocks = partition(max(squares) + 1, num_blocks)
    return [sum(squares.get(layer, 0.0) for layer in block) ** 0.5 for block in blocks]


def seeds(args) -> None:
    """`--method` against full backprop, one row per study directory (a seed), each at the rate the first
    directory's validation chose, and the mean over them: the gap of the means and the mean of the per-seed gaps
    with its standard error."""
    times = bench_times(args.times)
    first = Path(args.outs[0]) / f"{args.task}-{args.base}"
    rates = {name: chosen_run(first, name) for name in ("full-backprop", args.method)}
    if None in rates.values():
        raise SystemExit(f"{first}: no finished run of full-backprop and {args.method} to take the rates from")
    print(f"| seed dir | full backprop: final / best / spare | {args.method}: final / best / spare | gaps |")
    print("|" + " --- |" * 4)
    pairs: dict[str, list[tuple[float, float]]] = {}
    for out in args.outs:
        study = Path(out) / f"{args.task}-{args.base}"
        full, other = (study / run_dir_name(name) / rates[name].name for name in ("full-backprop", args.method))
        if (full / "val" / "eval.json").is_file() and (other / "val" / "eval.json").is_file():
            runs = [read_run(run) | {"spare": spare_loss(run)} for run in (full, other)]
            values = compare(*runs, times, args.method)
            for key, pair in values.items():
                pairs.setdefault(key, []).append(pair)
            cells = [
                " / ".join("-" if v is None else f"{v:.3f}" for v in column)
                for column in zip(*(values.get(key, (None, None)) for key in ("final", "best", "spare")))
            ]
            gaps = ", ".join(f"{key} {o / f - 1:+.1%}" for key, (f, o) in values.items())
            if args.ckpt_speedup:
                gaps += f", equal memory {equal_memory(*runs, args.ckpt_speedup)}"
            print(f"| {out} | {cells[0]} | {cells[1]} | {gaps} |")
    print()
    for key, values in pairs.items():
        f, o = (statistics.fmean(column) for column in zip(*values))
        gaps = [o_ / f_ - 1 for f_, o_ in values]
        error = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        print(
            f"{key}: {o:.3f} against {f:.3f} ({o / f - 1:+.1%}) over {len(gaps)} seeds; per-seed gaps "
            f"{statistics.fmean(gaps):+.1%} +- {error:.1%} (standard error)"
        )


def compare(full: dict, other: dict, times: dict[str, float], method: str) -> dict[str, tuple[float, float]]:
    """(full backprop's, the method's) held-out loss: final, best along the run, on the spare set where it was
    evaluated, and at equal time (full backprop's curve where the method's run ends) where a bench timed both."""
    values = {key: (full[key], other[key]) for key in ("final", "best", "spare") if None not in (full[key], other[key])}
    if times:
        end = other["curve"][-1][0] * times[method]
        timed = [(step * times["full-backprop"], loss) for step, loss in full["curve"]]
        values["equal time"] = (loss_at(timed, end), other["final"])
    return values


def equal_memory(full: dict, other: dict, speedup: float) -> str:
    """The method's time to full backprop's final loss x1.02 over full-backprop+ckpt's own time to it (checkpointed
    full backprop has full backprop's curve, bit for bit), the method `speedup` times as fast a step at equal memory."""
    target = full["final"] * 1.02
    reach = [time_to(run["curve"], target) for run in (full, other)]
    return "never" if reach[1] is None else f"{reach[1] / speedup / reach[0]:.2f}"


def chosen_run(study: Path, name: str) -> Path | None:
    """The method's finished run with the lowest validation loss."""
    runs = finished(study, name)
    if not runs:
        return None
    return runs[min(runs, key=lambda r: json.loads((runs[r] / "val" / "eval.json").read_text())["loss"])]


def spare_loss(run: Path) -> float | None:
    path = run / "spare" / "eval.json"
    return json.loads(path.read_text())["loss"] if path.is_file() else None


def loss_at(curve: list[tuple[float, float]], t: float) -> float:
    """The held-out loss at time t, linear between evaluations (the last one beyond the curve)."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def bench_times(path: str | None) -> dict[str, float]:
    """Method label -> median step time, from one interleaved `lcsb bench` (its bench.json); none without it."""
    if not path:
        return {}
    times = {m["name"]: m["median_step_time_s"] for m in json.loads(Path(path).read_text())["methods"]}
    # the paper's path is lcsb:4:identity in a bench since issue 49 (before: lcsb:4, the study's name for it)
    if "lcsb:4:identity" in times:
        times["lcsb:4"] = times["lcsb:4:identity"]
    return times


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def report(args) -> None:
    out = Path(args.out)
    times = bench_times(args.times)
    lines = []
    for study in sorted(p for p in out.iterdir() if (p / "data").is_dir()):
        best = {}
        for name in METHODS:
            runs = {rate: read_run(run) for rate, run in finished(study, name).items()}
            if runs:
                rate = min(runs, key=lambda r: runs[r]["val"])
                best[name] = {"rate": rate, "grid": runs, **runs[rate]}
                step_time = times.get(name, best[name]["step_time_s"])
                best[name]["timed"] = [(step * step_time, loss) for step, loss in best[name]["curve"]]
        lines += study_table(study.name, best)
        # with --times, only the methods the bench timed: a run's own step times on a busy machine are no time axis
        plot(study, {name: r for name, r in best.items() if not times or name in times})
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def study_table(title: str, best: dict) -> list[str]:
    full = best.get("full-backprop")
    lines = [
        f"### {title}",
        "",
        "| method | rates (val loss) | chosen | held-out best | held-out final | vs full (final) | "
        "accuracy | s/step | time to full x1.02 | at equal time: full | peak MiB |",
        "|" + " --- |" * 11,
    ]
    for name, r in best.items():
        grid = ", ".join(
            f"{rate:g}: {run['val']:.3f}{' div' if run['diverged'] else ''}" for rate, run in sorted(r["grid"].items())
        )
        versus = f"{100 * (r['final'] / full['final'] - 1):+.1f}%" if full else ""
        target = full["final"] * 1.02 if full else None
        reach = time_to(r["timed"], target) if target else None
        equal_time = f"{loss_at(full['timed'], r['timed'][-1][0]):.3f}" if full else ""
        accuracy = "" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        reached = "-" if reach is None else f"{reach:.0f} s"
        step_time = r["timed"][-1][0] / r["curve"][-1][0]
        cells = [name, grid, f"{r['rate']:g}", f"{r['best']:.3f}", f"{r['final']:.3f}", versus, accuracy]
        cells += [f"{step_time:.2f}", reached, equal_time, f"{r['peak_mem_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def plot(study: Path, best: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in best.items():
        ax.plot(*zip(*r["timed"]), marker="o", markersize=3, label=f"{name} (lr {r['rate']:g})")
    ax.set(xlabel="training seconds (median step time x steps)", ylabel="held-out loss", title=study.name)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(study.parent / f"{study.name}-time.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run")
    run.add_argument("out")
    run.add_argument("--task", choices=sorted(RECIPES), required=True)
    run.add_argument("--base", choices=sorted(BASES), default="fp32")
    run.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    run.add_argument("--rates", nargs="+", default=["3e-4", "1e-3", "3e-3"])
    run.add_argument("--epochs", type=int, default=3)
    run.add_argument("--train-size", type=int, default=120)
    run.add_argument("--seed", type=int, default=0)
    show = verbs.add_parser("report")
    show.add_argument("out")
    show.add_argument("--times")
    again = verbs.add_parser("spare")
    again.add_argument("out")
    again.add_argument("--task", choices=sorted(RECIPES), required=True)
    again.add_argument("--base", choices=sorted(BASES), default="fp32")
    again.add_argument("--methods", nargs="+", choices=list(METHODS), default=["full-backprop", "lcsb:4:suffix"])
    again.add_argument("--train-size", type=int, default=120)
    moved = verbs.add_parser("moves")
    moved.add_argument("out")
    moved.add_argument("--task", choices=sorted(RECIPES), required=True)
    moved.add_argument("--base", choices=sorted(BASES), default="fp32")
    moved.add_argument("--rate", required=True)
    moved.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    over = verbs.add_parser("seeds")
    over.add_argument("outs", nargs="+")
    over.add_argument("--task", choices=sorted(RECIPES), required=True)
    over.add_argument("--base", choices=sorted(BASES), default="fp32")
    over.add_argument("--method", choices=list(METHODS), default="lcsb:4:suffix")
    over.add_argument("--times")
    over.add_argument(
        "--ckpt-speedup",
        type=float,
        help="the method's step-time speedup over full-backprop+ckpt at equal memory, for the time-to-quality ratio",
    )
    args = parser.parse_args()
    {"run": run_grid, "report": report, "spare": spare, "moves": moves, "seeds": seeds}[args.verb](args)


if __name__ == "__main__":
    main()
