"""The data formats, one registry entry each: how a run's data loads, how its items become token rows, and how
held-out items are scored. Everything that differs between formats is here; the rest of lcsb asks the entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..recipe import Recipe
from .batching import collate
from .lamp2 import lamp2_dataset
from .lamp2_task import load_lamp2_task
from .lm import load_lm_task
from .personal import load_personal_task
from .preference import collate_feedback, collate_pairs, load_preference_task
from .task import TaskData


@dataclass(frozen=True)
class Format:
    """`load(recipe, tokenizer)` reads a run's data once. Items are questions encoded per run (with the recipe's
    length and retrieved profile) unless `encoded` (token rows already). Held-out items are scored by loss and
    perplexity, plus accuracy and macro-F1 over a label set when `labelled`, or exact match and ROUGE of
    generated answers when `generative`. `task` names the task in predictions.json."""

    name: str
    task: str
    load: Callable[[Recipe, Any], TaskData]
    encoded: bool = False
    labelled: bool = False
    generative: bool = False
    # (rows, pad id, max_length) -> a batch; preference rows hold a pair, feedback rows their KL partner
    batch: Callable[..., dict] | None = None

    def rows(self, recipe: Recipe, tokenizer, items: list) -> list[dict]:
        if self.encoded:
            return items
        return lamp2_dataset(tokenizer, items, recipe.data.max_length, recipe.data.profile_k)

    def collate(self, recipe: Recipe) -> Callable[[list[dict], int], dict]:
        """Rows -> a padded batch, as BatchStream calls it."""
        multiple = recipe.data.pad_to_multiple_of
        if self.batch:
            return partial(self.batch, max_length=recipe.data.max_length, multiple=multiple)
        return partial(collate, multiple=multiple)


FORMATS = {
    f.name: f
    for f in (
        Format("lamp2", "LaMP_2", load_lamp2_task, labelled=True),
        Format("jsonl", "personal", load_personal_task, labelled=True),
        Format("text", "text", load_lm_task, encoded=True),
        Format("completion", "completion", load_lm_task, encoded=True, generative=True),
        Format("chat", "chat", load_lm_task, encoded=True, generative=True),
        Format("preference", "preference", load_preference_task, encoded=True, batch=collate_pairs),
        Format("feedback", "feedback", load_preference_task, encoded=True, batch=collate_feedback),
    )
}


def format_of(recipe: Recipe) -> Format:
    return FORMATS[recipe.data.format]
