"""Held-out items of any format scored: loss and perplexity always; accuracy and macro-F1 for labelled formats
(labels.py); exact match and ROUGE of greedy answers for generative ones (text.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from ..data import format_of, token_rows
from ..recipe import Recipe
from .labels import lamp2_metrics, predict
from .text import generate_answers, held_out_loss, text_metrics

SUMMARY_KEYS = (
    "n",
    "loss",
    "perplexity",
    "accuracy",
    "macro_f1",
    "majority_accuracy",
    "out_of_label",
    "exact_match",
    "rouge1",
    "rougeL",
)


@contextlib.contextmanager
def silent(what: str, n: int):
    """The default `phase`: evaluation passes are not shown, and their progress goes nowhere."""
    yield lambda done: None


def evaluate_items(
    model,
    tokenizer,
    items: Sequence,
    recipe: Recipe,
    labels: Sequence[str] | None = None,
    phase=silent,
    loss_only: bool = False,
):
    """(predictions or None, metrics) of held-out items: LaMP questions or token rows of `recipe`'s format.
    `phase(what, n)` is a context manager around each pass that yields `advance(k)`, told as each k items are done
    (the CLI's progress display). `loss_only`: loss and perplexity, no predictions."""
    rows = token_rows(recipe, tokenizer, list(items))
    with phase("held-out loss", len(rows)) as advance:
        metrics = held_out_loss(model, rows, tokenizer.pad_token_id, recipe.eval.batch_size, advance)
    fmt = format_of(recipe)
    if loss_only:
        return None, {"n": len(rows), **metrics}
    if fmt.labelled:
        with phase(f"{recipe.eval.mode} mode", len(items)) as advance:
            preds = predict(model, tokenizer, items, recipe, advance)
        return preds, {**lamp2_metrics([q.output for q in items], preds, labels), **metrics}
    if fmt.generative:
        with phase("generation", len(rows)) as advance:
            preds = generate_answers(
                model, tokenizer, rows, recipe.eval.max_new_tokens, recipe.eval.batch_size, recipe.eval.stop, advance
            )
        return preds, {**text_metrics([row["reference"] for row in rows], preds), **metrics}
    return None, {"n": len(rows), **metrics}


def summary_row(metrics: dict) -> dict:
    """The headline numbers of an evaluation (for metrics.jsonl rows, bench and reports)."""
    return {key: metrics[key] for key in SUMMARY_KEYS if key in metrics}


def item_id(item) -> str:
    return item["id"] if isinstance(item, dict) else item.id


def predictions_file(items: Sequence, preds: Sequence[str], task: str) -> dict:
    """LaMP's {"task", "golds": [{"id", "output"}]} shape, for every format."""
    return {"task": task, "golds": [{"id": item_id(item), "output": p} for item, p in zip(items, preds)]}
