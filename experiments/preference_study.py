"""The preference study (docs/RESULTS.md): DPO, ORPO and KTO on SmolLM2 and the style-preference sample, full backprop
against lcsb's best variant, each at its own rate chosen on a validation split, then at equal epochs and equal time
over seeds on the held-out pairs (other message templates: held out by user turn).

    python experiments/preference_study.py run OUT [--objectives dpo orpo kto] [--methods full-backprop lcsb:4:suffix]
        [--rates 1e-4 3e-4 1e-3] [--epochs 1] [--seeds 0 1]
    python experiments/preference_study.py report OUT      # OUT/report.md

Every 5th training pair goes to the validation split (a feedback row follows its pair), the rest train. The sweep runs
seed 0 at each rate and scores it on the validation split; the rate with the best validation accuracy (then margin)
is the method's. At that rate, each seed trains `--epochs` epochs (equal epochs; seed 0 is the sweep's run) and lcsb
also trains for full backprop's time (equal time: full backprop's steps x its median step time over lcsb's median
step time, both from the same seed's equal-epochs runs). `run` skips what already finished, so it continues where it
stopped. A step takes 8 pairs (dpo, orpo) or 16 feedback rows (kto): 16 responses either way. Every number comes from
`lcsb train` and `lcsb eval`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "prefs-smollm2.yaml"
PREFS = REPO / "recipes" / "data" / "prefs"
METHODS = {
    "full-backprop": ["method=full-backprop"],
    "lcsb:4:suffix": ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=suffix"],
    "lcsb:4:exact": ["method=lcsb", "lcsb.blocks=4", "lcsb.upper_path=exact"],
}
FORMAT = {"dpo": "pairs", "orpo": "pairs", "kto": "feedback"}
# rows a step: 8 pairs, or 16 unpaired feedback rows (the same 16 responses a step)
BATCH = {"pairs": 8, "feedback": 16}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def split_data(out: Path) -> dict[str, int]:
    """OUT/data/{pairs,feedback}_{train,val}.jsonl; returns the training rows of each kind."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    pairs = read_jsonl(PREFS / "pairs_train.jsonl")
    held = {row["id"] for i, row in enumerate(pairs) if i % 5 == 4}
    feedback = read_jsonl(PREFS / "feedback_train.jsonl")
    sizes = {}
    for kind, rows, pair_id in (
        ("pairs", pairs, lambda r: r["id"]),
        ("feedback", feedback, lambda r: r["id"][: r["id"].rindex("-")]),
    ):
        train = [row for row in rows if pair_id(row) not in held]
        write_jsonl(data / f"{kind}_train.jsonl", train)
        write_jsonl(data / f"{kind}_val.jsonl", [row for row in rows if pair_id(row) in held])
        sizes[kind] = len(train)
    return sizes


def data_overrides(out: Path, objective: str, split: str) -> list[str]:
    kind = FORMAT[objective]
    held_out = out / "data" / f"{kind}_val.jsonl" if split == "val" else PREFS / f"{kind}_eval.jsonl"
    fmt = ["data.format=feedback"] if kind == "feedback" else []
    return [*fmt, f"data.train={out / 'data' / f'{kind}_train.jsonl'}", f"data.eval={held_out}"]


def lcsb(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "lcsb_cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lcsb {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def train(out: Path, run: Path, objective: str, method: str, rate: float, steps: int, seed: int) -> dict:
    if not (run / "summary.json").exists():
        overrides = [
            f"objective={objective}",
            *METHODS[method],
            *data_overrides(out, objective, "val"),
            f"train.lr={rate}",
            f"train.max_steps={steps}",
            f"train.batch_size={BATCH[FORMAT[objective]]}",
            f"train.seed={seed}",
            "train.save_every=0",
        ]
        lcsb("train", str(RECIPE), *overrides, "--output", str(run), "--force")
    return json.loads((run / "summary.json").read_text())


def evaluate(out: Path, run: Path, objective: str, split: str) -> dict:
    target = run / f"eval-{split}"
    if not (target / "eval.json").exists():
        lcsb("eval", str(run), "--output", str(target), *data_overrides(out, objective, split))
    return json.loads((target / "eval.json").read_text())


def base_eval(out: Path, objective: str) -> dict:
    target = out / f"base-{FORMAT[objective]}"
    if not (target / "eval.json").exists():
        lcsb(
            "eval",
            str(RECIPE),
            f"objective={objective}",
            "--output",
            str(target),
            *data_overrides(out, objective, "test"),
        )
    return json.loads((target / "eval.json").read_text())


def run(args) -> None:
    out = args.out
    sizes = split_data(out)
    results = {"epochs": args.epochs, "seeds": args.seeds, "rates": args.rates, "objectives": {}}
    for objective in args.objectives:
        steps = math.ceil(args.epochs * sizes[FORMAT[objective]] / BATCH[FORMAT[objective]])
        row = results["objectives"][objective] = {"base": base_eval(out, objective), "steps": steps, "methods": {}}
        for method in args.methods:
            sweep = {}
            for rate in args.rates:
                run_dir = out / "sweep" / f"{objective}-{method}-{rate:g}"
                train(out, run_dir, objective, method, rate, steps, 0)
                sweep[rate] = evaluate(out, run_dir, objective, "val")
            chosen = max(args.rates, key=lambda r: (sweep[r]["accuracy"], sweep[r]["margin"]))
            row["methods"][method] = {"sweep": {f"{r:g}": sweep[r] for r in args.rates}, "rate": chosen, "seeds": {}}
            for seed in args.seeds:
                run_dir = out / ("sweep" if seed == 0 else f"seed{seed}") / f"{objective}-{method}-{chosen:g}"
                summary = train(out, run_dir, objective, method, chosen, steps, seed)
                row["methods"][method]["seeds"][seed] = {"equal_epochs": result(out, run_dir, objective, summary)}
        baseline = row["methods"].get("full-backprop")
        for method, entry in row["methods"].items():
            if method == "full-backprop" or baseline is None:
                continue
            for seed in args.seeds:
                equal_steps = equal_time_steps(
                    baseline["seeds"][seed]["equal_epochs"], entry["seeds"][seed]["equal_epochs"]
                )
                run_dir = out / f"time-seed{seed}" / f"{objective}-{method}-{entry['rate']:g}"
                summary = train(out, run_dir, objective, method, entry["rate"], equal_steps, seed)
                entry["seeds"][seed]["equal_time"] = result(out, run_dir, objective, summary)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    report(out)


def equal_time_steps(reference: dict, own: dict) -> int:
    """The steps `own` takes in `reference`'s training time (its steps x median step time), at least its own steps."""
    budget = reference["steps"] * reference["median_step_time_s"]
    return max(own["steps"], round(budget / own["median_step_time_s"]))


def result(out: Path, run_dir: Path, objective: str, summary: dict) -> dict:
    test = evaluate(out, run_dir, objective, "test")
    keys = ("steps", "median_step_time_s", "tokens_per_s", "peak_mem_mb", "final_loss", "wall_time_s")
    return {**{k: summary[k] for k in keys}, "accuracy": test["accuracy"], "margin": test["margin"]}


def joined(runs: list[dict], key: str, form: str) -> str:
    return " / ".join(form.format(r[key]) for r in runs)


def report(out: Path) -> None:
    results = json.loads((out / "results.json").read_text())
    lines = [
        f"Epochs {results['epochs']}, seeds {results['seeds']}, rates swept {results['rates']} on seed 0 (validation).",
        "",
        "| objective | method | rate | budget | steps | held-out accuracy (seeds) | margin (seeds) | median step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for objective, row in results["objectives"].items():
        base = row["base"]
        lines.append(f"| {objective} | base (adapter off) | | | 0 | {base['base_accuracy']:.3f} | 0 | |")
        for method, entry in row["methods"].items():
            for budget in ("equal_epochs", "equal_time"):
                runs = [entry["seeds"][s][budget] for s in map(str, results["seeds"]) if budget in entry["seeds"][s]]
                if not runs:
                    continue
                lines.append(
                    f"| {objective} | {method} | {entry['rate']:g} | {budget.replace('_', ' ')} | "
                    f"{joined(runs, 'steps', '{}')} | {joined(runs, 'accuracy', '{:.3f}')} | "
                    f"{joined(runs, 'margin', '{:.2f}')} | "
                    f"{joined(runs, 'median_step_time_s', '{:.2f} s')} |"
                )
        lines += ["", f"{objective} sweep (validation accuracy / margin):"]
        for method, entry in row["methods"].items():
            cells = ", ".join(f"{r}: {v['accuracy']:.3f} / {v['margin']:.2f}" for r, v in entry["sweep"].items())
            lines.append(f"- {method}: {cells}")
        lines.append("")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("out", type=Path)
    go.add_argument("--objectives", nargs="+", default=["dpo", "orpo", "kto"], choices=sorted(FORMAT))
    go.add_argument("--methods", nargs="+", default=["full-backprop", "lcsb:4:suffix"], choices=sorted(METHODS))
    go.add_argument("--rates", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3])
    go.add_argument("--epochs", type=float, default=1.0)
    go.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    show = sub.add_parser("report")
    show.add_argument("out", type=Path)
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args.out)


if __name__ == "__main__":
    main()
