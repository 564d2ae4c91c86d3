"""LaMP-2 (personalized movie tagging) in its official JSON layout: load, parse and encode questions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput

TAGS: tuple[str, ...] = (
    "sci-fi",
    "based on a book",
    "comedy",
    "action",
    "twist ending",
    "dystopia",
    "dark comedy",
    "classic",
    "psychology",
    "fantasy",
    "romance",
    "thought-provoking",
    "social commentary",
    "violence",
    "true story",
)
QUESTION = (
    "Which tag does this movie relate to among the following tags? "
    "Just answer with the tag name without further explanation."
)
ANSWER_CUE = "\nAnswer:"
_TAGS_OPEN = "tags: ["
_DESCRIPTION = "description:"


@dataclass(frozen=True)
class LampQuestion:
    id: str
    input: str
    profile: tuple[dict, ...]
    user_id: str | None
    output: str | None


def format_input(tags: Sequence[str], description: str) -> str:
    """The official LaMP-2 question text for this tag order and description."""
    return f"{QUESTION} {_TAGS_OPEN}{', '.join(tags)}] {_DESCRIPTION} {description}"


def _description_start(text: str) -> tuple[int, int]:
    """(index of 'tags: [', index just after 'description:'); ValueError if the layout is wrong."""
    start = text.find(_TAGS_OPEN)
    if start < 0:
        raise ValueError("the input lacks 'tags: [' (the LaMP-2 tag list)")
    close = text.find("]", start)
    if close < 0:
        raise ValueError("the tag list after 'tags: [' is not closed with ']'")
    desc = text.find(_DESCRIPTION, close)
    if desc < 0:
        raise ValueError("the input lacks 'description:' after the tag list")
    return start, desc + len(_DESCRIPTION)


def split_input(text: str) -> tuple[list[str], str]:
    """(tags in the order given inside the brackets, description)."""
    start, desc = _description_start(text)
    inside = text[start + len(_TAGS_OPEN) : text.find("]", start)]
    tags = [tag.strip() for tag in inside.split(",") if tag.strip()]
    return tags, text[desc:].strip()


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: file not found; check the data paths in the recipe") from None
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: cannot be read as UTF-8 text ({err}); point the recipe at a LaMP JSON file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BadInput(
            f"{path}: invalid JSON at line {err.lineno}, column {err.colno} ({err.msg}); "
            "the file may be truncated, re-download or regenerate it"
        ) from None


def _as_id(value: Any) -> str | None:
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _question(path: Path, index: int, item: Any) -> LampQuestion:
    where = f"{path}: question at index {index}"
    if not isinstance(item, dict) or _as_id(item.get("id")) is None or not isinstance(item.get("input"), str):
        raise BadInput(f'{where}: expected an object with string "id" and "input"; fix that entry')
    qid = _as_id(item["id"])
    where = f"{path}: question id {qid!r} (index {index})"
    try:
        split_input(item["input"])
    except ValueError as err:
        raise BadInput(f"{where}: {err}; use the official LaMP-2 question text") from None
    profile = item.get("profile", [])
    if not isinstance(profile, list) or not all(
        isinstance(p, dict) and isinstance(p.get("tag"), str) and isinstance(p.get("description"), str) for p in profile
    ):
        raise BadInput(f'{where}: "profile" must be a list of objects with string "tag" and "description"')
    user = item.get("user_id")
    return LampQuestion(qid, item["input"], tuple(profile), None if user is None else str(user), None)


def _golds(path: Path) -> dict[str, str]:
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("golds"), list):
        raise BadInput(f'{path}: expected {{"task": "LaMP_2", "golds": [...]}}; is this a LaMP outputs file?')
    if data.get("task", "LaMP_2") != "LaMP_2":
        raise BadInput(f"{path}: task is {data['task']!r}, expected 'LaMP_2'; point the recipe at LaMP-2 outputs")
    golds: dict[str, str] = {}
    for index, gold in enumerate(data["golds"]):
        gid = _as_id(gold.get("id")) if isinstance(gold, dict) else None
        if gid is None or not isinstance(gold.get("output"), str):
            raise BadInput(f'{path}: gold at index {index}: expected {{"id", "output"}} with string output')
        if gold["output"].strip() not in TAGS:
            raise BadInput(
                f"{path}: gold id {gid!r} (index {index}): {gold['output']!r} is not one of the 15 LaMP-2 tags; "
                f"use one of: {', '.join(TAGS)}"
            )
        if gid in golds:
            raise BadInput(f"{path}: gold id {gid!r} appears twice (index {index}); keep one")
        golds[gid] = gold["output"].strip()
    return golds


def load_lamp2(questions_path: str | Path, outputs_path: str | Path | None = None) -> list[LampQuestion]:
    """Questions (with golds joined by id when outputs_path is given); BadInput on any malformed entry."""
    questions_path = Path(questions_path)
    data = _read_json(questions_path)
    if not isinstance(data, list):
        raise BadInput(f"{questions_path}: expected a JSON list of questions; is this a LaMP *_questions.json?")
    questions = [_question(questions_path, i, item) for i, item in enumerate(data)]
    seen: set[str] = set()
    for index, q in enumerate(questions):
        if q.id in seen:
            raise BadInput(f"{questions_path}: question id {q.id!r} appears twice (index {index}); ids must be unique")
        seen.add(q.id)
    if outputs_path is None:
        return questions
    golds = _golds(Path(outputs_path))
    for index, q in enumerate(questions):
        if q.id not in golds:
            raise BadInput(
                f"{outputs_path}: no gold for question id {q.id!r} (index {index} of {questions_path}); "
                "add it or use the outputs file that matches these questions"
            )
    return [LampQuestion(q.id, q.input, q.profile, q.user_id, golds[q.id]) for q in questions]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_ids(tokenizer: Any) -> list[int]:
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and list(tokenizer("")["input_ids"])[:1] == [bos] else []


def encode_example(
    tokenizer: Any, question_input: str, target: str | None, max_length: int, profile: Sequence[dict] = ()
) -> dict:
    """[profile statements] + prompt + " target" + eos, with labels only on the target.

    The prompt pieces (head up to 'description:', the description with its leading space, and '\nAnswer:')
    are tokenized separately so that over-long examples lose description tokens only: a cut tag list or
    answer would make the example wrong rather than short. Profile items (most relevant first) are stated
    as `the tag for the movie: "..." is "..."` lines before the question and get what the question leaves of
    `max_length`, whole statements only, the least relevant dropped first.
    """
    try:
        _, cut = _description_start(question_input)
    except ValueError as err:
        raise BadInput(f"LaMP-2 input: {err}") from None
    if tokenizer.eos_token_id is None:
        raise BadInput("the tokenizer has no eos token; use a tokenizer that defines one")
    head = _ids(tokenizer, question_input[:cut])
    tail = _ids(tokenizer, ANSWER_CUE)
    answer = [] if target is None else _ids(tokenizer, " " + target) + [tokenizer.eos_token_id]
    bos = bos_ids(tokenizer)
    fixed = len(bos) + len(head) + len(tail) + len(answer)
    if fixed > max_length:
        raise BadInput(
            f"max_length={max_length} is too small: the question, tag list and answer alone need {fixed} tokens; "
            f"set data.max_length to at least {fixed}"
        )
    description = _ids(tokenizer, question_input[cut:])[: max_length - fixed]
    context = _profile_ids(tokenizer, profile, max_length - fixed - len(description))
    prompt = bos + context + head + description + tail
    return {"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}


def profile_statement(description: str, tag: str) -> str:
    """LaMP's retrieval format for a profile item (also the built-in base's pretraining text)."""
    return f'the tag for the movie: "{description}" is "{tag}"'


def _profile_ids(tokenizer: Any, profile: Sequence[dict], budget: int) -> list[int]:
    ids: list[int] = []
    for item in profile:
        statement = _ids(tokenizer, profile_statement(item["description"], item["tag"]) + "\n")
        if len(ids) + len(statement) > budget:
            break
        ids += statement
    return ids


def lamp2_dataset(tokenizer: Any, questions: Sequence[LampQuestion], max_length: int, profile_k: int = 0):
    """Rows {input_ids, labels}; questions without a gold become prompt-only rows. A plain list: importing
    datasets (pyarrow) costs 83 MiB of resident memory, which the 1 GiB recipe cannot spare."""
    rows = []
    for q in questions:
        try:
            rows.append(encode_example(tokenizer, q.input, q.output, max_length, retrieve_profile(q, profile_k)))
        except BadInput as err:
            raise BadInput(f"question id {q.id!r}: {err}") from None
    return rows


def retrieve_profile(question: LampQuestion, k: int) -> list[dict]:
    """The k profile items whose descriptions best match the question's (BM25, as LaMP's retrieval baseline)."""
    if k <= 0 or not question.profile:
        return []
    from rank_bm25 import BM25Okapi

    corpus = [_bm25_tokens(item["description"]) for item in question.profile]
    scores = BM25Okapi(corpus).get_scores(_bm25_tokens(split_input(question.input)[1]))
    ranked = sorted(range(len(corpus)), key=lambda i: (-scores[i], i))
    return [question.profile[i] for i in ranked[:k]]


def _bm25_tokens(text: str) -> list[str]:
    return text.lower().split()


def user_of(question: LampQuestion) -> str:
    """The time-based split names the user; in the user-based split each question is its own user."""
    return question.user_id if question.user_id is not None else question.id


def group_by_user(questions: Sequence[LampQuestion]) -> dict[str, list[LampQuestion]]:
    groups: dict[str, list[LampQuestion]] = {}
    for q in questions:
        groups.setdefault(user_of(q), []).append(q)
    return groups


def profile_questions(question: LampQuestion) -> list[LampQuestion]:
    """A user's profile items as training questions (description -> tag); each keeps the rest as profile."""
    items = question.profile
    return [
        LampQuestion(
            id=str(item["id"]),
            input=format_input(TAGS, item["description"]),
            profile=tuple(other for other in items if other is not item),
            user_id=user_of(question),
            output=item["tag"],
        )
        for item in items
    ]
