"""docs/RESULTS.md's study tables from `scripts/quality_study.sh`'s output dir: one row per method and budget,
mean ± std over seeds of the held-out metrics, with steps, speedup and peak RSS; the untrained base beside them.

    python scripts/study_tables.py runs/study
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = {
    "lamp2": ("accuracy", "macro_f1", "loss"),
    "qa": ("exact_match", "rougeL", "loss"),
    "text": ("perplexity", "loss"),
}


def cell(mean: float, std: float | None) -> str:
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def task_table(out: Path, task: str) -> list[str]:
    metrics = METRICS[task]
    lines = [
        "| budget | method | steps | speedup | peak RSS (MB) | final train loss | "
        + " | ".join(f"held-out {m}" for m in metrics)
        + " |",
        "|" + " --- |" * (6 + len(metrics)),
    ]
    base = out / f"{task}-base" / "eval.json"
    if base.is_file():
        values = json.loads(base.read_text())
        lines.append("| | base (untrained) | 0 | | | | " + " | ".join(cell(values[m], None) for m in metrics) + " |")
    for budget in ("equal-steps", "equal-time"):
        path = out / f"{task}-{budget}" / "bench.json"
        if not path.is_file():
            continue
        bench = json.loads(path.read_text())
        for method in bench["methods"]:
            std = method["std"]
            evals = [cell(method["eval"][m], std["eval"][m]) for m in metrics]
            steps = f"{method['steps']:.0f}" if not std["steps"] else f"{method['steps']:.1f} ± {std['steps']:.1f}"
            lines.append(
                f"| {budget} | {method['name']} | {steps} | "
                f"{method['speedup']:.2f}x | {method['peak_mem_mb']:.0f} | "
                f"{cell(method['final_loss'], std['final_loss'])} | " + " | ".join(evals) + " |"
            )
    return lines


def nf4_table(out: Path) -> list[str]:
    lines = ["| lr | method | diverged (seeds) | final train loss | held-out perplexity |", "|" + " --- |" * 5]
    for path in sorted(out.glob("nf4-lr*/bench.json"), key=lambda p: float(p.parent.name[len("nf4-lr") :])):
        bench = json.loads(path.read_text())
        for method in bench["methods"]:
            diverged = sum(bool(s["diverged"]) for s in method["seeds"])
            ppl = method["eval"]["perplexity"] if method.get("eval") else float("nan")
            lines.append(
                f"| {path.parent.name[len('nf4-lr') :]} | {method['name']} | {diverged} of "
                f"{len(method['seeds'])} | {method['final_loss']:.3f} | {ppl:.2f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    for task in METRICS:
        if any(args.out.glob(f"{task}-*")):
            print(f"### {task}\n\n" + "\n".join(task_table(args.out, task)) + "\n")
    if any(args.out.glob("nf4-lr*")):
        print("### nf4\n\n" + "\n".join(nf4_table(args.out)) + "\n")


if __name__ == "__main__":
    main()
