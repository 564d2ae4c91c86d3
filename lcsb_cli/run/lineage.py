"""A nightly lineage (`lcsb night`): one directory per user, the same command every night, each night a single run
warm-started (`lora.init`) from the promoted adapter.

A night: the items newer than the lineage's watermark (the newest timestamp it has learned) are new, and so are
older ones whose content hash it has not seen (a backfilled or relabelled line: `late`). Ordered by timestamp, the
newest `data.eval_fraction` of them are held out, the rest (with the previous night's held-out items) are trained on
together with a seeded replay sample of earlier items (`lineage.replay`); the promoted adapter and the night's are
scored on the held-out items and on a fixed probe of the earliest items learned (forgetting).
The night's adapter is promoted unless it lost more than `lineage.tolerance` accuracy on either.

The lineage dir: lineage.json (the nights, the items seen, the promoted adapter: replaced in one os.replace, the
promotion), config.yaml (the recipe; with adapter -> the promoted adapter, `lcsb export/chat/generate/eval` take
it as a run), nights/NNN/ (the night's plan and item files, its run in run/, its evaluations), report.md/json.
Every phase before the promotion is re-derived or resumed from its files, so a night killed anywhere ends as an
uninterrupted one; a night on unchanged data changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from datetime import datetime, timezone
from pathlib import Path

from ..atomic import write_json_atomic, write_text_atomic
from ..data.personal import PersonalExample, load_personal
from ..errors import BadInput
from ..recipe import Recipe, dump, replace_key
from ..rundir import RunDir
from ..rundir.checkpoint import checkpoint_dirs
from .engine import train_adapter

FILES = ("train.jsonl", "held_out.jsonl")
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
    data = load_personal(recipe.data.train, recipe.data.on_bad_line, recipe.data.labels)
    plan = _plan(recipe, state, data.examples)
    if plan is None:
        record = {"night": None, "new": 0, "current": state["current"], "nights": len(state["nights"])}
        _write_report(root, state, record)
        return record
    night_dir = root / "nights" / f"{plan['night']:03d}"
    _write_plan(root, night_dir, plan, data.examples)
    night_recipe = _night_recipe(recipe, root, night_dir, state, data.labels)
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
    data = load_personal(recipe.data.train, recipe.data.on_bad_line, recipe.data.labels)
    users = sorted({e.user for e in data.examples if e.user is not None})
    if not users:
        raise BadInput(f'lcsb night: data.user is all, but no line of {recipe.data.train} has a "user"')
    for user in users:
        if user in (".", "..") or Path(user).name != user:
            raise BadInput(f"lcsb night: user id {user!r} cannot name a lineage dir (users/ID); rename it in the data")
    recipe = replace_key(recipe, "data.labels", list(data.labels))
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
        "watermark": max(plan["newest"], state.get("watermark") or plan["newest"]),
    }
    write_json_atomic(Path(root) / "lineage.json", new_state)
    return new_state


def item_hash(example: PersonalExample) -> str:
    fields = [example.id, example.text, example.label, example.timestamp, example.user]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:32]


def _check(recipe: Recipe) -> None:
    if recipe.data.format != "jsonl":
        raise BadInput(f"lcsb night: data.format is {recipe.data.format}; a lineage reads phone labels (jsonl)")
    if recipe.data.eval is not None:
        raise BadInput("lcsb night: data.eval is set; a lineage holds out the newest items of each night itself")
    if recipe.lora.init is not None:
        raise BadInput("lcsb night: lora.init is set; a lineage starts each night from its own promoted adapter")
    if not 0 <= recipe.lineage.replay < 1:
        raise BadInput(f"lineage.replay is {recipe.lineage.replay}; a share in [0, 1), e.g. 0.5")


def _plan(recipe: Recipe, state: dict, examples: list[PersonalExample]) -> dict | None:
    """Tonight's items as hashes: new (newer than the watermark, or at or before it and unseen: late), held out (the
    newest), trained (carried + the rest of new), replayed."""
    by_time = sorted((e for e in examples if recipe.data.user in (None, e.user)), key=lambda e: (e.timestamp, e.id))
    seen, watermark = set(state["seen"]), state.get("watermark")
    new = [e for e in by_time if watermark is None or e.timestamp > watermark or item_hash(e) not in seen]
    if len(new) < 2:
        return None
    held = min(max(1, math.ceil(len(new) * recipe.data.eval_fraction)), len(new) - 1)
    train_new = [item_hash(e) for e in new[:-held]]
    present = {item_hash(e) for e in by_time}
    pool = sorted(h for h in state["learned"] if h in present and h not in set(state["probe"]))
    fresh = [h for h in state["carried"] if h in present] + train_new
    share = recipe.lineage.replay
    count = min(len(pool), round(len(fresh) * share / (1 - share)))
    number = len(state["nights"]) + 1
    return {
        "night": number,
        "new": [item_hash(e) for e in new],
        "held_out": [item_hash(e) for e in new[-held:]],
        "train_new": train_new,
        "learned": fresh,
        "train": fresh + random.Random(f"{recipe.train.seed}-{number}").sample(pool, count),
        "replay": count,
        "probe_size": recipe.lineage.probe,
        "range": [_iso(new[0].timestamp), _iso(new[-1].timestamp)],
        "newest": new[-1].timestamp,
        "late": sum(watermark is not None and e.timestamp <= watermark for e in new),
    }


def _write_plan(root: Path, night_dir: Path, plan: dict, examples: list[PersonalExample]) -> None:
    """The night's item files (the same bytes however often they are rewritten) and, on the first night, the probe."""
    by_hash = {item_hash(e): e for e in examples}
    night_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(night_dir / "plan.json", plan)
    for name, hashes in zip(FILES, (plan["train"], plan["held_out"])):
        _write_items(night_dir / name, [by_hash[h] for h in hashes])
    if not (root / "probe.jsonl").is_file():
        probe = plan["train_new"][: plan["probe_size"]]
        _write_items(root / "probe.jsonl", [by_hash[h] for h in probe])


def _write_items(path: Path, examples: list[PersonalExample]) -> None:
    rows = ({"id": e.id, "text": e.text, "label": e.label, "timestamp": e.timestamp, "user": e.user} for e in examples)
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _night_recipe(recipe: Recipe, root: Path, night_dir: Path, state: dict, labels) -> Recipe:
    changes = {
        "data.train": str(night_dir / "train.jsonl"),
        "data.eval": str(night_dir / "held_out.jsonl"),
        "data.labels": list(labels),
        "lora.init": None if state["current"] is None else str(_adapter(root, state["current"])),
        "overnight.report": False,
        "output_dir": str(night_dir / "run"),
    }
    for key, value in changes.items():
        recipe = replace_key(recipe, key, value)
    return recipe


def _adapter(root: Path, current: str | None) -> Path | None:
    return None if current is None else root / current


def _scores(recipe: Recipe, root: Path, night_dir: Path, phase: str, adapter: Path | None) -> dict:
    """Accuracy on the held-out items and on the probe, each evaluation kept in its own dir (eval.json) and read
    back when the night runs again."""
    from ..evaluate import run_eval

    scores = {}
    for name, items in (("held_out", night_dir / "held_out.jsonl"), ("probe", root / "probe.jsonl")):
        output = night_dir / f"eval-{phase}-{name}"
        if not (output / "eval.json").is_file():
            run_eval(replace_key(recipe, "data.eval", str(items)), output, adapter)
        scores[name] = json.loads((output / "eval.json").read_text())["accuracy"]
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
    tolerance = recipe.lineage.tolerance
    promoted = all(after[k] >= before[k] - tolerance for k in before)
    return {
        "night": plan["night"],
        "range": plan["range"],
        "new": len(plan["new"]),
        "late": plan["late"],
        "held_out": len(plan["held_out"]),
        "trained": len(plan["train"]),
        "replayed": plan["replay"],
        "before": before,
        "after": after,
        "tolerance": tolerance,
        "promoted": promoted,
        "adapter": str(night_dir / "run" / "adapter") if promoted else state["current"],
        "steps": summary["steps"],
        "train_time_s": summary.get("wall_time_s"),
    }


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
    scores = ", ".join(
        f"{name} accuracy {record['before'][name]:.3f} -> {record['after'][name]:.3f}" for name in record["before"]
    )
    verdict = "promoted" if record["promoted"] else f"not promoted, kept {record['adapter'] or 'the base model'}"
    job = record.get("job") or {}
    if job.get("throttled_s") or job.get("waited_s") or job.get("interruptions"):
        verdict += (
            f" (cooled down {job['throttled_s']:.0f} s, waited {job['waited_s']:.0f} s for the window, "
            f"{job['interruptions']} interruptions)"
        )
    late = f", {record['late']} of them late" if record.get("late") else ""
    return (
        f"night {record['night']}: {record['new']} new items{late} ({record['range'][0]} .. {record['range'][1]}), "
        f"trained on {record['trained']} ({record['replayed']} replayed); {scores}: {verdict}"
    )


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
