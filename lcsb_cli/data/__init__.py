"""Training and evaluation data: recipe -> one TaskData (loaded once per run, by the format's registry entry in
formats.py) -> token rows -> micro-batches (batching.py)."""

from __future__ import annotations

from ..recipe import Recipe
from .batching import BatchStream
from .formats import FORMATS, Format, format_of
from .lamp2 import TAGS
from .lamp2_task import user_profile_questions, user_tasks, users
from .packing import pack_rows
from .task import TaskData

__all__ = [
    "FORMATS",
    "TAGS",
    "BatchStream",
    "Format",
    "TaskData",
    "build_train_batches",
    "format_of",
    "load_task",
    "token_rows",
    "user_profile_questions",
    "user_tasks",
    "users",
]


def load_task(recipe: Recipe, tokenizer) -> TaskData:
    return format_of(recipe).load(recipe, tokenizer)


def token_rows(recipe: Recipe, tokenizer, items: list) -> list[dict]:
    """{input_ids, labels} rows of training or held-out items."""
    return format_of(recipe).rows(recipe, tokenizer, items)


def build_train_batches(
    recipe: Recipe, tokenizer, task: TaskData | None = None, shard: tuple[int, int] = (0, 1)
) -> BatchStream:
    """The run's micro-batches; with data.packing, of the training rows packed (data/packing.py)."""
    task = load_task(recipe, tokenizer) if task is None else task
    rows = token_rows(recipe, tokenizer, task.train)
    if recipe.data.packing:
        rows = pack_rows(rows, recipe.data.max_length)
    collate = format_of(recipe).collate(recipe)
    return BatchStream(rows, recipe.train.batch_size, recipe.train.seed, tokenizer.pad_token_id, shard, collate)
