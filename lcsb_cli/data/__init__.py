"""Training data: recipe -> tokenized dataset -> a deterministic stream of micro-batches."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..recipe import Recipe
from .batching import BatchStream
from .lamp2 import lamp2_dataset, load_lamp2


def build_train_batches(recipe: Recipe, tokenizer) -> BatchStream:
    cfg = recipe.data
    for key, path in (("data.train", cfg.train), ("data.train_labels", cfg.train_labels)):
        if path is not None and not Path(path).is_file():
            raise BadInput(f"{key}: {path} does not exist")
    questions = load_lamp2(cfg.train, cfg.train_labels)
    if any(q.output is None for q in questions):
        raise BadInput(f"data.train_labels: training needs gold tags; give the *_outputs.json of {cfg.train}")
    dataset = lamp2_dataset(tokenizer, questions, cfg.max_length)
    return BatchStream(dataset, recipe.train.batch_size, recipe.train.seed, tokenizer.pad_token_id)
