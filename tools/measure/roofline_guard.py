"""The performance regression guard that is not a timed test: each method's share of its dtype's matmul limit, from
one interleaved `lcsb bench`, as rows of docs/RESULTS.md's roofline-guard table with the host's kind beside them.

    python tools/measure/roofline_guard.py [RECIPE] [KEY=VALUE ...] [--compare METHOD ...] [--steps N] [--record FILE]

Without --record the rows are printed; with it they also go into FILE before its `<!-- roofline-guard -->` line.
A share that falls between two rows of the same host kind is a regression to look for (ratios, one run each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MARKER = "<!-- roofline-guard -->"


def bench(recipe: str, overrides: list[str], compare: list[str], steps: int, out: Path) -> dict:
    flags = [flag for method in compare for flag in ("--compare", method)]
    command = [sys.executable, "-m", "lcsb_cli", "bench", recipe, *overrides, *flags, "--steps", str(steps)]
    subprocess.run([*command, "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())


def rows(result: dict, label: str) -> list[str]:
    probe, limits = result["matmul_probe"], result["matmul_limit_gflops"]
    day = datetime.date.today().isoformat()
    return [
        f"| {day} | {probe['host']}, {probe['threads']} threads | {label} | {m['name']} | "
        f"{m['compute_dtype'].replace('float32', 'fp32').replace('bfloat16', 'bf16')} | "
        f"{limits[m['compute_dtype']]:.1f} | {m['achieved_gflops']:.1f} | {m['roofline_fraction']:.0%} | "
        f"{m['speedup']:.2f}x |"
        for m in result["methods"]
        if "roofline_fraction" in m
    ]


def record(path: Path, lines: list[str]) -> None:
    text = path.read_text()
    if MARKER not in text:
        raise SystemExit(f"{path}: no {MARKER} line to put the rows before")
    path.write_text(text.replace(MARKER, "\n".join([*lines, MARKER])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="recipes/bench-smollm2.yaml")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides")
    parser.add_argument("--compare", action="append", default=None, help="default: full-backprop")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--record", type=Path, help="docs/RESULTS.md: add the rows to its roofline-guard table")
    args = parser.parse_intermixed_args()
    with tempfile.TemporaryDirectory() as out:
        result = bench(args.recipe, args.overrides, args.compare or ["full-backprop"], args.steps, Path(out))
    label = " ".join([Path(args.recipe).stem, *args.overrides]) + f" ({platform.machine()})"
    lines = rows(result, label)
    print("\n".join(lines))
    if args.record:
        record(args.record, lines)


if __name__ == "__main__":
    main()
