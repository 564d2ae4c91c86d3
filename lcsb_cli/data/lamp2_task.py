"""LaMP-2 runs: pooled training uses `data.train`; per-user training (`data.user`) uses a user's profile items,
taken from that user's evaluation questions, as (description -> tag) examples, the on-device personalization
setting. `data.eval` (+ `data.eval_labels`) is held out."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..recipe import Recipe
from .lamp2 import TAGS, LampQuestion, group_by_user, load_lamp2, profile_questions
from .task import TaskData


def load_lamp2_task(recipe: Recipe, tokenizer=None) -> TaskData:
    held_out = eval_questions(recipe) if recipe.data.eval is not None else []
    return TaskData("lamp2", train_questions(recipe), held_out, TAGS)


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
    return {
        user: TaskData("lamp2", user_profile_questions(questions), questions, TAGS)
        for user, questions in users(recipe).items()
    }


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
