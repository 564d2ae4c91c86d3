"""`lcsb eval`: a base model, an adapter or a per-user run's adapters on the held-out items; eval.json and
predictions.json written under the output's writer lock."""

from __future__ import annotations

from pathlib import Path

from ..data import format_of
from ..recipe import Recipe
from ..rundir import RunDir
from ..runtime import logging_into
from .items import evaluate_items, predictions_file, silent, summary_row
from .labels import lamp2_metrics, majority_accuracy
from .preference import preference_metrics


def write_results(output: Path, result: dict, predictions: dict | None) -> None:
    """eval.json and predictions.json, under `output`'s writer lock, with the libraries' records of this
    evaluation in its log file."""
    from ..atomic import write_json_atomic

    run = RunDir(output)
    with run.writer(), logging_into(run.log):
        write_json_atomic(run.eval_json, result)
        if predictions is not None:
            write_json_atomic(run.predictions, predictions)


def run_eval(
    recipe: Recipe, output: Path, adapter: Path | None = None, run_dir: Path | None = None, phase=silent
) -> dict:
    """Evaluate the base model, an adapter, or (with `data.user: all`) each user's adapter of `run_dir`;
    write eval.json and predictions.json into `output`."""
    from ..backends import get_backend
    from ..data import load_task
    from ..model.load import load_model

    # before the evaluation, not after it
    RunDir(output).check_no_writer()
    backend = get_backend(recipe.backend, recipe.npu_sim)
    loaded = load_model(recipe, backend.device, adapter)
    backend.prepare(loaded)
    if recipe.data.user == "all":
        items, preds, metrics = _per_user_eval(loaded, recipe, run_dir, phase)
    else:
        task = load_task(recipe, loaded.tokenizer)
        items = task.need_held_out()
        if recipe.objective != "sft":
            preds, metrics = None, preference_metrics(loaded.model, items, loaded.tokenizer.pad_token_id, recipe, phase)
        else:
            preds, metrics = evaluate_items(loaded.model, loaded.tokenizer, items, recipe, task.labels, phase)
        if task.labels is not None:
            metrics["majority_accuracy"] = majority_accuracy([q.output for q in task.train], [q.output for q in items])
    result = {
        "task": format_of(recipe).task,
        "format": recipe.data.format,
        "mode": recipe.eval.mode,
        **evaluated(recipe, adapter, run_dir),
        "profile_k": recipe.data.profile_k,
        **metrics,
    }
    write_results(output, result, None if preds is None else predictions_file(items, preds, format_of(recipe).task))
    return result


def evaluated(recipe: Recipe, adapter: Path | None, run_dir: Path | None) -> dict:
    """What an eval.json scored: the base model, one adapter, or each user's adapter of a per-user run dir."""
    from ..recipe import to_dict

    per_user = recipe.data.user == "all" and run_dir is not None and adapter is None
    what = (
        f"per-user adapters in {RunDir(run_dir).adapters}"
        if per_user
        else f"adapter {adapter}"
        if adapter
        else f"base model {recipe.model.name}"
    )
    return {
        "evaluated": what,
        "model": recipe.model.name,
        "adapter": str(adapter) if adapter else None,
        "adapters": str(RunDir(run_dir).adapters) if per_user else None,
        "run_dir": str(run_dir) if run_dir else None,
        "recipe": to_dict(recipe),
    }


def _per_user_eval(loaded, recipe: Recipe, run_dir: Path | None, phase=silent):
    """LaMP-2 per-user runs: each user's questions with that user's adapter (the base model without a run dir)."""
    from ..data import TAGS, user_profile_questions, users
    from ..model.adapter import load_into
    from ..model.memory import release_freed_memory

    items, preds, per_user, hits = [], [], {}, 0
    by_user = users(recipe)
    # every user's adapter checked before the first is evaluated
    for user_id in by_user if run_dir is not None else ():
        _check_user_adapter(loaded.model, RunDir(run_dir).user_adapter(user_id))
    for user_id, user_questions in by_user.items():
        # what the last user's scoring freed goes back to the OS before this user's batches of other lengths come
        release_freed_memory()
        if run_dir is not None:
            load_into(loaded.model, RunDir(run_dir).user_adapter(user_id))
        with phase(user_id, len(user_questions)) as advance:
            user_preds, metrics = evaluate_items(loaded.model, loaded.tokenizer, user_questions, recipe, TAGS)
            advance(len(user_questions))
        majority = majority_accuracy(
            [q.output for q in user_profile_questions(user_questions)], [q.output for q in user_questions]
        )
        per_user[user_id] = {
            **summary_row(metrics),
            "majority_accuracy": majority,
            "adapter": str(RunDir(run_dir).user_adapter(user_id)) if run_dir is not None else None,
        }
        hits += round(majority * len(user_questions))
        items += user_questions
        preds += user_preds
    metrics = {
        **lamp2_metrics([q.output for q in items], preds),
        "majority_accuracy": hits / len(items),
        "users": per_user,
    }
    return items, preds, metrics


def _check_user_adapter(model, path: Path) -> None:
    from ..errors import BadInput
    from ..model.adapter import check_fits

    if not path.is_dir():
        raise BadInput(f"{path}: this user's adapter is missing; finish the run with `lcsb train ... --resume`")
    check_fits(model, path)
