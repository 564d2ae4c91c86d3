"""Training and evaluation data: recipe -> questions -> tokenized dataset -> micro-batches.

LaMP-2: pooled training uses `data.train`; per-user training (`data.user`) uses a user's profile items, taken
from that user's evaluation questions, as (description -> tag) examples, the on-device personalization setting.
jsonl (phone-collected labels): one file, split by time; the newest `data.eval_fraction` is held out.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..recipe import Recipe
from .batching import BatchStream
from .lamp2 import TAGS, LampQuestion, group_by_user, lamp2_dataset, load_lamp2, profile_questions
from .personal import PersonalData, filter_user, load_personal, time_split, to_questions


def personal_data(recipe: Recipe) -> PersonalData:
    data = recipe.data
    if not Path(data.train).is_file():
        raise BadInput(f"data.train: {data.train} does not exist")
    return load_personal(data.train, data.on_bad_line, data.labels)


def _personal_split(recipe: Recipe) -> tuple[list[LampQuestion], list[LampQuestion]]:
    """(training questions, held-out newest questions) of a jsonl recipe."""
    loaded = personal_data(recipe)
    examples = loaded.examples if recipe.data.user is None else filter_user(loaded.examples, recipe.data.user)
    if not examples:
        raise BadInput(f"data.user: no items of user {recipe.data.user!r} in {recipe.data.train}")
    older, newest = time_split(examples, recipe.data.eval_fraction)
    return to_questions(older, loaded.labels), to_questions(newest, loaded.labels)


def label_set(recipe: Recipe) -> tuple[str, ...]:
    """The labels predictions are scored over: LaMP-2's 15 tags, or the jsonl file's label set."""
    return personal_data(recipe).labels if recipe.data.format == "jsonl" else TAGS


def _load(recipe: Recipe, questions_key: str, labels_key: str) -> list[LampQuestion]:
    questions_path, labels_path = getattr(recipe.data, questions_key), getattr(recipe.data, labels_key)
    if questions_path is None:
        raise BadInput(f"data.{questions_key}: no file given (a LaMP-2 *_questions.json)")
    for key, path in ((questions_key, questions_path), (labels_key, labels_path)):
        if path is not None and not Path(path).is_file():
            raise BadInput(f"data.{key}: {path} does not exist")
    questions = load_lamp2(questions_path, labels_path)
    if any(q.output is None for q in questions):
        raise BadInput(f"data.{labels_key}: gold tags are needed; give the *_outputs.json of {questions_path}")
    return questions


def eval_questions(recipe: Recipe) -> list[LampQuestion]:
    if recipe.data.format == "jsonl":
        return _personal_split(recipe)[1]
    questions = _load(recipe, "eval", "eval_labels")
    if recipe.data.user not in (None, "all"):
        questions = users(recipe).get(recipe.data.user) or []
    return questions


def users(recipe: Recipe) -> dict[str, list[LampQuestion]]:
    """Evaluation questions grouped by user, in a stable order."""
    groups = group_by_user(_load(recipe, "eval", "eval_labels"))
    if recipe.data.user not in (None, "all") and recipe.data.user not in groups:
        known = ", ".join(sorted(groups)[:5])
        raise BadInput(f"data.user: no user {recipe.data.user!r} in {recipe.data.eval} (e.g. {known})")
    return dict(sorted(groups.items()))


def train_questions(recipe: Recipe) -> list[LampQuestion]:
    if recipe.data.format == "jsonl":
        return _personal_split(recipe)[0]
    if recipe.data.user is None:
        return _load(recipe, "train", "train_labels")
    if recipe.data.user == "all":
        raise BadInput("data.user: 'all' trains one adapter per user; pick a user id for a single run")
    return user_profile_questions(users(recipe)[recipe.data.user])


def user_profile_questions(questions: list[LampQuestion]) -> list[LampQuestion]:
    """The union of a user's profile items (over their questions) as training questions."""
    seen, merged = set(), []
    for q in questions:
        for item in profile_questions(q):
            if item.id not in seen:
                seen.add(item.id)
                merged.append(item)
    if not merged:
        raise BadInput(f"data.user: user {questions[0].user_id!r} has no profile items to train on")
    return merged


def build_train_batches(recipe: Recipe, tokenizer, questions: list[LampQuestion] | None = None,
                        shard: tuple[int, int] = (0, 1)) -> BatchStream:
    questions = train_questions(recipe) if questions is None else questions
    dataset = lamp2_dataset(tokenizer, questions, recipe.data.max_length, recipe.data.profile_k)
    return BatchStream(dataset, recipe.train.batch_size, recipe.train.seed, tokenizer.pad_token_id, shard)
