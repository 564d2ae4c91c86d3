"""Training and evaluation data: recipe -> one TaskData (loaded once per run) -> micro-batches.

LaMP-2: pooled training uses `data.train`; per-user training (`data.user`) uses a user's profile items, taken
from that user's evaluation questions, as (description -> tag) examples, the on-device personalization setting.
jsonl (phone-collected labels): one file, split by time; the newest `data.eval_fraction` is held out.
text, completion, chat (lm.py): `data.eval`, or a seeded `data.eval_fraction` of `data.train`, is held out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from ..recipe import Recipe
from .batching import BatchStream
from .lamp2 import TAGS, LampQuestion, group_by_user, lamp2_dataset, load_lamp2, profile_questions
from .lm import FORMATS as LM_FORMATS
from .lm import SPLIT_SEED, load_lm_split
from .personal import PersonalData, filter_user, load_personal, time_split, to_questions


@dataclass
class TaskData:
    """A run's data, loaded once: training and held-out items, the label set of a classification task, and the
    lines skipped under data.on_bad_line: skip."""

    format: str
    train: list  # LampQuestion (lamp2, jsonl) or token rows {id, input_ids, labels, ...} (text, completion, chat)
    held_out: list
    labels: tuple[str, ...] | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)

    @property
    def generative(self) -> bool:
        """Held-out items are answered by generation and scored by exact match and ROUGE."""
        return self.format in ("completion", "chat")

    def need_held_out(self) -> list:
        if not self.held_out:
            raise BadInput("data.eval: no held-out items to evaluate; give data.eval (LaMP-2: a *_questions.json "
                           "with data.eval_labels)")
        return self.held_out


def load_task(recipe: Recipe, tokenizer) -> TaskData:
    if recipe.data.format in LM_FORMATS:
        return _lm_task(recipe, tokenizer)
    if recipe.data.format == "jsonl":
        loaded = personal_data(recipe)
        train, held_out = _personal_split(recipe, loaded)
        return TaskData("jsonl", train, held_out, loaded.labels, loaded.skipped)
    held_out = eval_questions(recipe) if recipe.data.eval is not None else []
    return TaskData("lamp2", train_questions(recipe), held_out, TAGS)


def _lm_task(recipe: Recipe, tokenizer) -> TaskData:
    data = recipe.data
    train = load_lm_split(data.train, data.format, tokenizer, data.max_length, data.on_bad_line)
    if data.eval is not None:
        held_out = load_lm_split(data.eval, data.format, tokenizer, data.max_length, data.on_bad_line)
        return TaskData(data.format, train.rows, held_out.rows, None, train.skipped + held_out.skipped)
    if len(train.rows) < 2:
        raise BadInput(f"data.eval_fraction: {data.train} gives {len(train.rows)} example; a held-out split needs "
                       "at least 2 (or give data.eval)")
    order = _seeded_order(len(train.rows))
    n_eval = min(max(1, round(len(order) * data.eval_fraction)), len(order) - 1)
    held = set(order[:n_eval])
    rows = train.rows
    return TaskData(data.format, [r for i, r in enumerate(rows) if i not in held],
                    [r for i, r in enumerate(rows) if i in held], None, train.skipped)


def _seeded_order(n: int) -> list[int]:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()


def personal_data(recipe: Recipe) -> PersonalData:
    data = recipe.data
    if not Path(data.train).is_file():
        raise BadInput(f"data.train: {data.train} does not exist")
    return load_personal(data.train, data.on_bad_line, data.labels)


def _personal_split(recipe: Recipe, loaded: PersonalData) -> tuple[list[LampQuestion], list[LampQuestion]]:
    """(training questions, held-out newest questions) of a jsonl recipe."""
    examples = loaded.examples if recipe.data.user is None else filter_user(loaded.examples, recipe.data.user)
    if not examples:
        raise BadInput(f"data.user: no items of user {recipe.data.user!r} in {recipe.data.train}")
    older, newest = time_split(examples, recipe.data.eval_fraction)
    return to_questions(older, loaded.labels), to_questions(newest, loaded.labels)


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
    """LaMP-2's held-out questions (a user's, with data.user)."""
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
    """LaMP-2's training questions: data.train, or a user's profile items."""
    if recipe.data.user is None:
        return _load(recipe, "train", "train_labels")
    if recipe.data.user == "all":
        raise BadInput("data.user: 'all' trains one adapter per user; pick a user id for a single run")
    return user_profile_questions(users(recipe)[recipe.data.user])


def user_tasks(recipe: Recipe) -> dict[str, TaskData]:
    """LaMP-2 per-user runs (data.user: all): each user's profile items to train on and questions to evaluate,
    from one read of the questions file."""
    return {user: TaskData("lamp2", user_profile_questions(questions), questions, TAGS)
            for user, questions in users(recipe).items()}


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


def token_rows(recipe: Recipe, tokenizer, items: list) -> list[dict]:
    """{input_ids, labels} rows of training or held-out items: questions are encoded here, LM rows already are."""
    if recipe.data.format in LM_FORMATS:
        return items
    return lamp2_dataset(tokenizer, items, recipe.data.max_length, recipe.data.profile_k)


def build_train_batches(recipe: Recipe, tokenizer, task: TaskData | None = None,
                        shard: tuple[int, int] = (0, 1)) -> BatchStream:
    task = load_task(recipe, tokenizer) if task is None else task
    rows = token_rows(recipe, tokenizer, task.train)
    return BatchStream(rows, recipe.train.batch_size, recipe.train.seed, tokenizer.pad_token_id, shard)
