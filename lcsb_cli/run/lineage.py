"""A nightly lineage (`lcsb night`): one directory per user, the same command every night, each night a single run
warm-started (`lora.init`) from the promoted adapter.

A night reads phone labels, chat, completion, text, preference or feedback data (data/records.py). In a file
whose records carry timestamps, the items newer than the lineage's watermark (the newest timestamp it has learned)
are new, and so are older ones whose content hash it has not seen (a backfilled or relabelled line: `late`); in a
file without timestamps, the records whose content hash it has not seen, in the file's order. The newest
`data.eval_fraction` of them are held out, the rest (with the previous night's held-out items) are trained on
together with a seeded replay sample of earlier items (`lineage.replay`); the promoted adapter and the night's are
scored on the held-out items and on a fixed probe of the earliest items learned (forgetting): accuracy for labels,
preference and feedback data, held-out loss for chat, completion and text. The night's adapter is promoted unless
it lost more than `lineage.tolerance` (accuracy, or nats of loss) on either.

The lineage dir: lineage.json (the nights, the items seen, the promoted adapter: replaced in one os.replace, the
promotion), config.yaml (the recipe; with adapter -> the promoted adapter, `lcsb export/chat/generate/eval` take
it as a run), nights/NNN/ (the night's plan and item files, its run in run/, its evaluations), report.md/json.
Every phase before the promotion is re-derived or resumed from its files, so a night killed anywhere ends as an
uninterrupted one; a night on unchanged data changes nothing.
"""

from __future__ import annotations

import json
import math
import os
import random
from datetime import datetime, timezone
from pathlib import Path

from ..atomic import write_json_atomic, write_text_atomic
from ..data.records import Record, json_lines, read_records
from ..errors import BadInput
from ..recipe import Recipe, dump, replace_key
from ..rundir import RunDir
from ..rundir.checkpoint import checkpoint_dirs
from .engine import train_adapter

FILES = ("train.jsonl", "held_out.jsonl")
# the formats whose nights are scored by held-out loss (lower is better)
LOSS_SCORED = ("chat", "completion", "text")
EMPTY = {"nights": [], "seen": [], "carried": [], "learned": [], "probe": [], "current": None, "watermark": None}


def night(recipe: Recipe, root: Path, display) -> dict:
    """Run tonight's night of the lineage in `root` (or finish an interrupted one); returns its record, or a record
    with `new: 0` when no item came in."""
    _check(recipe)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    state = read_state(root)
    write_text_atomic(root / "config.yaml", dump(replace_key(recipe, "output_dir", str(root))))
    _link_current(root, state)
    records = read_records(recipe.data)
    plan = _plan(recipe, state, records.items, records.timed)
    if plan is None:
        record = {"night": None, "new": 0, "current": state["current"], "nights": len(state["nights"])}
        _write_report(root, state, record)
        return record
    night_dir = root / "nights" / f"{plan['night']:03d}"
    _write_plan(root, night_dir, plan, records.items)
    night_recipe = _night_recipe(recipe, root, night_dir, state, records.labels, len(plan["train"]))
    before = _scores(night_recipe, root, night_dir, "before", _adapter(root, state["current"]))
    summary = _train_night(night_recipe, night_dir / "run", display)
    if summary.get("stopped"):
        return {"night": plan["night"], "stopped": summary["stopped"]}
    after = _scores(night_recipe, root, night_dir, "after", night_dir / "run" / "adapter")
    record = _record(recipe, plan, state, before, after, summary, night_dir.relative_to(root))
    record["job"] = _job_figures(RunDir(night_dir / "run"))
    state = promote(root, state, plan, record)
    _link_current(root, state)
    _write_report(root, state, record)
    return record


def nights_per_user(recipe: Recipe, root: Path, display) -> dict:
    """`data.user: all`: tonight's night of every user's lineage, in root/users/ID (each a lineage dir), one user
    after another over the same label set; returns each user's record."""
    records = read_records(recipe.data)
    users = sorted({r.user for r in records.items if r.user is not None})
    if not users:
        raise BadInput(f'lcsb night: data.user is all, but no line of {recipe.data.train} has a "user"')
    for user in users:
        if user in (".", "..") or Path(user).name != user:
            raise BadInput(f"lcsb night: user id {user!r} cannot name a lineage dir (users/ID); rename it in the data")
    if records.labels is not None:
        recipe = replace_key(recipe, "data.labels", list(records.labels))
    return {user: night(replace_key(recipe, "data.user", user), Path(root) / "users" / user, display) for user in users}


def read_state(root: Path) -> dict:
    path = Path(root) / "lineage.json"
    return json.loads(path.read_text()) if path.is_file() else json.loads(json.dumps(EMPTY))


def promote(root: Path, state: dict, plan: dict, record: dict) -> dict:
    """The one step that ends a night: lineage.json with the night's record, the items it saw and the adapter now
    promoted, replaced atomically."""
    new_state = {
        "nights": [*state["nights"], record],
        "seen": sorted({*state["seen"], *plan["new"]}),
        "carried": plan["held_out"],
        "learned": [*state["learned"], *plan["learned"]],
        "probe": state["probe"] or plan["train_new"][: plan["probe_size"]],
        "current": record["adapter"],
        "watermark": None if plan["newest"] is None else max(plan["newest"], state.get("watermark") or plan["newest"]),
    }
    write_json_atomic(Path(root) / "lineage.json", new_state)
    return new_state


def _check(recipe: Recipe) -> None:
    if recipe.data.eval is not None:
        raise BadInput("lcsb night: data.eval is set; a lineage holds out the newest items of each night itself")
    if recipe.lora.init is not None:
        raise BadInput("lcsb night: lora.init is set; a lineage starts each night from its own promoted adapter")
    if not 0 <= recipe.lineage.replay < 1:
        raise BadInput(f"lineage.replay is {recipe.lineage.replay}; a share in [0, 1), e.g. 0.5")


def _plan(recipe: Recipe, state: dict, records: list[Record], timed: bool) -> dict | None:
    """Tonight's items as hashes: new (unseen, or newer than the watermark; an unseen one at or before it is late),
    held out (the newest, or the last in the file), trained (carried + the rest of new), replayed."""
    mine = [r for r in records if recipe.data.user in (None, r.user)]
    ordered = sorted(mine, key=lambda r: (r.timestamp, str(r.row.get("id", "")))) if timed else mine
    seen, watermark = set(state["seen"]), state.get("watermark")
    new = [r for r in ordered if r.hash not in seen or (watermark is not None and r.timestamp > watermark)]
    if len(new) < 2:
        return None
    held = min(max(1, math.ceil(len(new) * recipe.data.eval_fraction)), len(new) - 1)
    train_new = [r.hash for r in new[:-held]]
    present = {r.hash for r in ordered}
    pool = sorted(h for h in state["learned"] if h in present and h not in set(state["probe"]))
    fresh = [h for h in state["carried"] if h in present] + train_new
    share = recipe.lineage.replay
    count = min(len(pool), round(len(fresh) * share / (1 - share)))
    number = len(state["nights"]) + 1
    return {
        "night": number,
        "new": [r.hash for r in new],
        "held_out": [r.hash for r in new[-held:]],
        "train_new": train_new,
        "learned": fresh,
        "train": fresh + random.Random(f"{recipe.train.seed}-{number}").sample(pool, count),
        "replay": count,
        "probe_size": recipe.lineage.probe,
        "range": [_iso(new[0].timestamp), _iso(new[-1].timestamp)] if timed else None,
        "newest": new[-1].timestamp,
        "late": sum(watermark is not None and r.timestamp <= watermark for r in new),
    }


def _write_plan(root: Path, night_dir: Path, plan: dict, records: list[Record]) -> None:
    """The night's item files (the same bytes however often they are rewritten) and, on the first night, the probe."""
    by_hash = {r.hash: r for r in records}
    night_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(night_dir / "plan.json", plan)
    for name, hashes in zip(FILES, (plan["train"], plan["held_out"])):
        write_text_atomic(night_dir / name, json_lines([by_hash[h] for h in hashes]))
    if not (root / "probe.jsonl").is_file():
        probe = plan["train_new"][: plan["probe_size"]]
        write_text_atomic(root / "probe.jsonl", json_lines([by_hash[h] for h in probe]))


def _night_recipe(recipe: Recipe, root: Path, night_dir: Path, state: dict, labels, items: int) -> Recipe:
    changes = {
        "data.train": str(night_dir / "train.jsonl"),
        "data.eval": str(night_dir / "held_out.jsonl"),
        "data.labels": None if labels is None else list(labels),
        "lora.init": None if state["current"] is None else str(_adapter(root, state["current"])),
        "overnight.report": False,
        "output_dir": str(night_dir / "run"),
    }
    if recipe.lineage.passes > 0:
        per_step = recipe.train.batch_size * recipe.train.grad_accum
        changes["train.max_steps"] = math.ceil(recipe.lineage.passes * items / per_step)
    for key, value in changes.items():
        recipe = replace_key(recipe, key, value)
    return recipe


def _adapter(root: Path, current: str | None) -> Path | None:
    return None if current is None else root / current


def metric(recipe: Recipe) -> str:
    """What a night is scored by: accuracy where the items have answers to rank, else the held-out loss."""
    return "loss" if recipe.data.format in LOSS_SCORED else "accuracy"


def _scores(recipe: Recipe, root: Path, night_dir: Path, phase: str, adapter: Path | None) -> dict:
    """The metric on the held-out items and on the probe, each evaluation kept in its own dir (eval.json) and read
    back when the night runs again."""
    from ..evaluate import run_eval

    scores = {}
    for name, items in (("held_out", night_dir / "held_out.jsonl"), ("probe", root / "probe.jsonl")):
        output = night_dir / f"eval-{phase}-{name}"
        if not (output / "eval.json").is_file():
            run_eval(replace_key(recipe, "data.eval", str(items)), output, adapter)
        scores[name] = json.loads((output / "eval.json").read_text())[metric(recipe)]
    return scores


def _train_night(recipe: Recipe, run_dir: Path, display) -> dict:
    """The night's run: finished (its summary), resumed from its checkpoint, or started afresh."""
    run = RunDir(run_dir)
    if run.summary.is_file():
        summary = json.loads(run.summary.read_text())
        if not summary.get("stopped"):
            return summary
    resume = run.is_run() and bool(checkpoint_dirs(run.checkpoints))
    return train_adapter(recipe, run_dir, display, resume=resume, force=not resume)


def _record(recipe, plan: dict, state: dict, before: dict, after: dict, summary: dict, night_dir: Path) -> dict:
    tolerance, scored_by = recipe.lineage.tolerance, metric(recipe)
    promoted = promotes(scored_by, before, after, tolerance)
    return {
        "night": plan["night"],
        "range": plan["range"],
        "new": len(plan["new"]),
        "late": plan["late"],
        "held_out": len(plan["held_out"]),
        "trained": len(plan["train"]),
        "replayed": plan["replay"],
        "metric": scored_by,
        "before": before,
        "after": after,
        "tolerance": tolerance,
        "promoted": promoted,
        "adapter": str(night_dir / "run" / "adapter") if promoted else state["current"],
        "steps": summary["steps"],
        "train_time_s": summary.get("wall_time_s"),
    }


def promotes(scored_by: str, before: dict, after: dict, tolerance: float) -> bool:
    """No score worse by more than `tolerance`: accuracy down, or loss up."""
    sign = -1 if scored_by == "loss" else 1
    return all(sign * (after[name] - before[name]) >= -tolerance for name in before)


def _job_figures(run: RunDir) -> dict:
    """What the overnight job did during the night's run (job.json): cool-down and window waits, interruptions."""
    job = json.loads(run.job.read_text()) if run.job.is_file() else {}
    return {
        "throttled_s": job.get("throttled_s", 0.0),
        "waited_s": job.get("waited_s", 0.0),
        "interruptions": len(job.get("interruptions", [])),
        "resumes": job.get("resumes", 0),
    }


def _link_current(root: Path, state: dict) -> None:
    """adapter -> the promoted adapter (a symlink swapped by os.replace), derived from lineage.json and repaired on
    every night."""
    link = root / "adapter"
    target = state["current"]
    if target is None or (link.is_symlink() and os.readlink(link) == target):
        return
    temporary = root / ".adapter.tmp"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target, target_is_directory=True)
    os.replace(temporary, link)


def _write_report(root: Path, state: dict, record: dict) -> None:
    """report.json (tonight's record and the history) and report.md: what the morning shows."""
    write_json_atomic(root / "report.json", {"tonight": record, "nights": state["nights"]})
    history = [f"- {morning_line(past, state)}" for past in state["nights"]]
    lines = ["# Tonight", "", morning_line(record, state), "", "## Every night", "", *history, ""]
    write_text_atomic(root / "report.md", "\n".join(lines))


def morning_line(record: dict, state: dict) -> str:
    """One line: what tonight did, with the figures before and after and which adapter is served."""
    if record.get("night") is None:
        return f"no new items since night {len(state['nights'])}; the promoted adapter stays {state['current']}"
    scored_by = record.get("metric", "accuracy")
    scores = ", ".join(
        f"{name} {scored_by} {record['before'][name]:.3f} -> {record['after'][name]:.3f}" for name in record["before"]
    )
    verdict = "promoted" if record["promoted"] else f"not promoted, kept {record['adapter'] or 'the base model'}"
    job = record.get("job") or {}
    if job.get("throttled_s") or job.get("waited_s") or job.get("interruptions"):
        verdict += (
            f" (cooled down {job['throttled_s']:.0f} s, waited {job['waited_s']:.0f} s for the window, "
            f"{job['interruptions']} interruptions)"
        )
    late = f", {record['late']} of them late" if record.get("late") else ""
    span = f" ({record['range'][0]} .. {record['range'][1]})" if record["range"] else ""
    return (
        f"night {record['night']}: {record['new']} new items{late}{span}, "
        f"trained on {record['trained']} ({record['replayed']} replayed); {scores}: {verdict}"
    )


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
