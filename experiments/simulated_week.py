"""A simulated week of nights (issue 50): the shipped phone-labels sample split by timestamp into 7 days; night d
learns day d and is scored on day d+1 (forward chaining), so nights 1..6 are scored (day 7 has no next day).

Three arms on the same days, all from recipes/overnight.yaml (lamp-tiny) on the cpu backend, batch 8:
  lineage      `lcsb night` (run/lineage.py) on the items so far, lineage.replay 0.5, a fixed train.max_steps a night
               (--steps) or lineage.passes over the night's training items (--lineage-passes)
  scratch      a fresh adapter every night on all items so far, ceil(passes * items / batch) steps (cost grows)
  no-replay    the lineage with lineage.replay=0
  ungated      the lineage with lineage.replay=0 and a tolerance no night exceeds: every night promoted, plain
               sequential fine-tuning (what forgetting looks like when neither replay nor the gate guards against it)
Each night's served adapter (the lineage's promoted one) is scored by accuracy on the next day's items and on all of
day 1's items (the day-1 probe; forgetting = its best accuracy during the week minus its last). Training time is the
runs' summary wall_time_s; a lineage night's total (its gate evaluations included) is reported too.

    nice -n 10 .venv/bin/python experiments/simulated_week.py --output /tmp/week
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

from lcsb_cli.data.personal import load_personal
from lcsb_cli.evaluate.pipeline import run_eval
from lcsb_cli.paths import recipe_file
from lcsb_cli.recipe import load_recipe, replace_key
from lcsb_cli.run import lineage
from lcsb_cli.run.entry import train
from lcsb_cli.run.hooks import SilentDisplay

SAMPLE = Path(__file__).resolve().parent.parent / "recipes" / "data" / "personal" / "movies.jsonl"
DAYS = 7
BATCH = 8
ARMS = ("lineage", "scratch", "no-replay", "ungated")


def split_days(lines: list[str], count: int) -> list[list[str]]:
    """The sample's lines in `count` days: its calendar dates (UTC) in contiguous groups of near-equal size."""
    rows = sorted(lines, key=lambda line: (json.loads(line)["timestamp"], json.loads(line)["id"]))
    dates = sorted({json.loads(line)["timestamp"][:10] for line in rows})
    group = {date: i * count // len(dates) for i, date in enumerate(dates)}
    days: list[list[str]] = [[] for _ in range(count)]
    for line in rows:
        days[group[json.loads(line)["timestamp"][:10]]].append(line)
    return days


def write_days(days: list[list[str]], data: Path) -> None:
    """day-D.jsonl (that day's items) and upto-D.jsonl (days 1..D) for every day."""
    data.mkdir(parents=True, exist_ok=True)
    for d in range(1, len(days) + 1):
        (data / f"day-{d}.jsonl").write_text("".join(days[d - 1]))
        (data / f"upto-{d}.jsonl").write_text("".join(line for day in days[:d] for line in day))


def base_recipe(args, labels) -> object:
    overrides = [
        "backend=cpu",
        f"train.batch_size={BATCH}",
        f"train.seed={args.seed}",
        "overnight.report=false",
        "train.save_every=0",
    ]
    return replace_key(load_recipe(recipe_file("overnight"), overrides), "data.labels", list(labels))


def score(recipe, data: Path, out: Path, night: int, adapter: Path | None, name: str) -> dict:
    """Accuracy of `adapter` (None: the base) on the next day's items and on day 1's."""
    result = {}
    for key, items in (("next", data / f"day-{night + 1}.jsonl"), ("day1", data / "day-1.jsonl")):
        scored = replace_key(
            replace_key(recipe, "data.train", str(data / f"upto-{night}.jsonl")), "data.eval", str(items)
        )
        target = out / "evals" / name / f"night-{night}-{key}"
        shutil.rmtree(target, ignore_errors=True)
        result[key] = run_eval(scored, target, adapter)["accuracy"]
    return result


def lineage_night(recipe, data: Path, out: Path, night: int, name: str) -> dict:
    root = out / name
    served_before = lineage.read_state(root)["current"]
    night_recipe = replace_key(recipe, "data.train", str(data / f"upto-{night}.jsonl"))
    start = time.perf_counter()
    record = lineage.night(night_recipe, root, SilentDisplay())
    total = time.perf_counter() - start
    current = lineage.read_state(root)["current"]
    row = score(recipe, data, out, night, None if current is None else root / current, name)
    before = score(recipe, data, out, night, None if served_before is None else root / served_before, name + "-before")
    return {
        **row,
        "next_before": before["next"],
        "promoted": record["promoted"],
        "train_s": record["train_time_s"],
        "night_s": total,
        "steps": record["steps"],
        "trained": record["trained"],
    }


def scratch_night(recipe, data: Path, out: Path, night: int, passes: float) -> dict:
    items = len(load_personal(data / f"upto-{night}.jsonl").examples)
    steps = math.ceil(passes * items / BATCH)
    run_recipe = replace_key(recipe, "data.train", str(data / f"upto-{night}.jsonl"))
    run_recipe = replace_key(
        replace_key(run_recipe, "data.eval", str(data / f"day-{night + 1}.jsonl")), "train.max_steps", steps
    )
    run_dir = out / "scratch" / f"night-{night}"
    start = time.perf_counter()
    summary = train(run_recipe, run_dir, SilentDisplay(), force=True)
    total = time.perf_counter() - start
    row = score(recipe, data, out, night, run_dir / "adapter", "scratch")
    return {
        **row,
        "promoted": True,
        "train_s": summary["wall_time_s"],
        "night_s": total,
        "steps": steps,
        "trained": items,
    }


def run_week(args) -> dict:
    out = Path(args.output)
    for name in ARMS:
        shutil.rmtree(out / name, ignore_errors=True)
    days = split_days(SAMPLE.read_text().splitlines(keepends=True), DAYS)
    write_days(days, out / "data")
    recipe = base_recipe(args, load_personal(SAMPLE).labels)
    lineage_recipe = replace_key(
        replace_key(recipe, "train.max_steps", args.steps), "lineage.passes", args.lineage_passes
    )
    nights: dict[str, list[dict]] = {name: [] for name in ARMS}
    for night in range(1, DAYS):
        nights["lineage"].append(lineage_night(lineage_recipe, out / "data", out, night, "lineage"))
        nights["scratch"].append(scratch_night(recipe, out / "data", out, night, args.passes))
        no_replay = replace_key(lineage_recipe, "lineage.replay", 0.0)
        nights["no-replay"].append(lineage_night(no_replay, out / "data", out, night, "no-replay"))
        ungated = replace_key(no_replay, "lineage.tolerance", 1e9)
        nights["ungated"].append(lineage_night(ungated, out / "data", out, night, "ungated"))
        print(f"night {night} done: " + json.dumps({k: v[-1] for k, v in nights.items()}), flush=True)
    return {
        "days": [len(day) for day in days],
        "seed": args.seed,
        "steps": args.steps,
        "passes": args.passes,
        "lineage_passes": args.lineage_passes,
        "nights": nights,
    }


def table(week: dict) -> str:
    """Per night and arm: next-day accuracy (the previous served adapter's in brackets for the lineages), day-1
    accuracy, promoted, steps, cumulative training time; then forgetting and the goals' figures."""
    lines = [
        "| night | arm | next-day acc | day-1 acc | promoted | steps | cum. train s | cum. night s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ARMS:
        train_s = night_s = 0.0
        for n, row in enumerate(week["nights"][name], start=1):
            train_s, night_s = train_s + row["train_s"], night_s + row["night_s"]
            before = f" (was {row['next_before']:.3f})" if "next_before" in row else ""
            promoted = "yes" if row["promoted"] else "no"
            lines.append(
                f"| {n} | {name} | {row['next']:.3f}{before} | {row['day1']:.3f} | {promoted} | {row['steps']} "
                f"| {train_s:.0f} | {night_s:.0f} |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(summary_lines(week))


def summary_lines(week: dict) -> list[str]:
    rows = week["nights"]
    cost = {name: sum(r["train_s"] for r in rows[name]) for name in ARMS}
    last = {name: rows[name][-1]["next"] for name in ARMS}
    forgetting = {name: max(r["day1"] for r in rows[name]) - rows[name][-1]["day1"] for name in ARMS}
    regressed = [n for n, r in enumerate(rows["lineage"], start=1) if r["promoted"] and r["next"] < r["next_before"]]
    return [
        f"- last night, next-day accuracy: lineage {last['lineage']:.3f}, scratch {last['scratch']:.3f}, "
        f"no-replay {last['no-replay']:.3f}, ungated {last['ungated']:.3f}; lineage - scratch = "
        f"{100 * (last['lineage'] - last['scratch']):+.1f} points",
        f"- cumulative training time: lineage {cost['lineage']:.0f} s = {cost['lineage'] / cost['scratch']:.2f} x "
        f"scratch's {cost['scratch']:.0f} s; no-replay {cost['no-replay']:.0f} s",
        "- day-1 forgetting (best - last), points: "
        + ", ".join(f"{name} {100 * forgetting[name]:.1f}" for name in ARMS),
        "- promoted lineage nights whose next-day accuracy fell below the adapter they replaced: "
        f"{regressed or 'none'}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="/tmp/week")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24, help="the lineage's train.max_steps, every night")
    parser.add_argument("--passes", type=float, default=3.0, help="scratch: passes over all items so far")
    parser.add_argument(
        "--lineage-passes", type=float, default=0.0, help="the lineages' lineage.passes (0: --steps every night)"
    )
    args = parser.parse_args()
    week = run_week(args)
    Path(args.output, "week.json").write_text(json.dumps(week, indent=1))
    print(table(week))


if __name__ == "__main__":
    main()
