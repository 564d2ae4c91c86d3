"""Phone-collected JSONL labels: loading, bad lines, the time split, the prompt format and the shipped sample."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from lcsb_cli.data.lamp2 import encode_example, split_input
from lcsb_cli.data.personal import (
    PROMPT,
    PersonalExample,
    filter_user,
    format_personal_input,
    load_personal,
    time_split,
    to_questions,
)
from lcsb_cli.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "recipes" / "data" / "personal" / "messages.jsonl"
T0 = datetime(2026, 11, 16, 8, 12, tzinfo=timezone.utc).timestamp()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ROOT / "configs" / "tokenizers" / "lcsb-bpe"))


def _row(i: int, label: str = "work", **extra) -> dict:
    return {"id": f"m{i}", "text": f"message number {i}", "label": label, "timestamp": T0 + i, **extra}


def _write(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "labels.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _ex(i: str, timestamp: float, label: str = "work", user: str | None = None) -> PersonalExample:
    return PersonalExample(i, f"text {i}", label, timestamp, user, 1)


# --- loading ------------------------------------------------------------------------------------------


def test_valid_file_loads_with_inferred_sorted_labels(tmp_path):
    path = _write(tmp_path, [_row(1, "work", user="alex"), "", "   ", _row(2, "family"), _row(3, "finance")])
    data = load_personal(path)
    assert [e.id for e in data.examples] == ["m1", "m2", "m3"]
    assert [e.line for e in data.examples] == [1, 4, 5]
    assert data.labels == ("family", "finance", "work")
    assert data.skipped == []
    assert data.examples[0].user == "alex" and data.examples[1].user is None
    assert data.examples[0].text == "message number 1" and data.examples[0].timestamp == T0 + 1


def test_given_labels_define_set_and_order(tmp_path):
    data = load_personal(_write(tmp_path, [_row(1, "work"), _row(2, "family")]), labels=["work", "travel", "family"])
    assert data.labels == ("work", "travel", "family")


@pytest.mark.parametrize(
    "stamp",
    [
        "2026-11-16T08:12:00Z",
        "2026-11-16T08:12:00",
        "2026-11-16T09:12:00+01:00",
        "2026-11-16T08:12:00+00:00",
        T0,
        int(T0),
    ],
)
def test_timestamps_iso_and_epoch(tmp_path, stamp):
    data = load_personal(_write(tmp_path, [_row(1, timestamp=stamp), _row(2, "family")]))
    assert data.examples[0].timestamp == T0
    assert isinstance(data.examples[0].timestamp, float)


@pytest.mark.parametrize("labels", [["work"], [], ["work", "work"], ["work", "a, b"], ["work", ""]])
def test_bad_given_labels_refused(tmp_path, labels):
    with pytest.raises(BadInput, match="label"):
        load_personal(_write(tmp_path, [_row(1, "work"), _row(2, "family")]), labels=labels)


def test_fewer_than_two_inferred_labels_refused(tmp_path):
    with pytest.raises(BadInput, match="at least 2 labels"):
        load_personal(_write(tmp_path, [_row(1, "work"), _row(2, "work")]))


def test_missing_file_and_not_utf8(tmp_path):
    with pytest.raises(BadInput, match="file not found"):
        load_personal(tmp_path / "nope.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(BadInput, match="UTF-8"):
        load_personal(binary)


def test_no_valid_example_refused(tmp_path):
    with pytest.raises(BadInput, match="no valid example"):
        load_personal(_write(tmp_path, ["{oops", ""]), on_bad_line="skip")
    with pytest.raises(BadInput, match="no valid example"):
        load_personal(_write(tmp_path, ["", "  "]))


def test_unknown_on_bad_line_refused(tmp_path):
    with pytest.raises(BadInput, match="on_bad_line"):
        load_personal(_write(tmp_path, [_row(1), _row(2, "family")]), on_bad_line="ignore")


# --- bad lines ------------------------------------------------------------------------------------------


def _without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


BAD_LINES = [
    ('{"id": "x", "text": ', "invalid JSON"),
    ('["a", "b"]', "JSON object"),
    (_without(_row(9), "text"), '"text"'),
    (_without(_row(9), "timestamp"), '"timestamp" is missing'),
    (_row(9, ""), '"label"'),
    ({**_row(9), "id": 9}, '"id"'),
    (_row(9, timestamp="yesterday"), "not ISO-8601"),
    (_row(9, timestamp=True), "timestamp"),
    (_row(9, user=5), '"user"'),
    ({**_row(9), "id": "m1"}, "already used on line 1"),
    (_row(9, "sports"), "not one of the recipe's labels"),
]


@pytest.mark.parametrize("bad,reason", BAD_LINES)
def test_bad_line_error_names_line(tmp_path, bad, reason):
    path = _write(tmp_path, [_row(1), _row(2, "family"), "", bad, _row(3)])
    with pytest.raises(BadInput) as err:
        load_personal(path, labels=["work", "family"])
    message = str(err.value)
    assert f"{path}: line 4: " in message and reason in message and "data.on_bad_line=skip" in message
    assert "\n" not in message


def test_bad_lines_skipped_and_listed(tmp_path):
    path = _write(tmp_path, [_row(1), _row(2, "family")] + [bad for bad, _ in BAD_LINES] + [_row(3)])
    data = load_personal(path, on_bad_line="skip", labels=["work", "family"])
    assert [e.id for e in data.examples] == ["m1", "m2", "m3"]
    assert [line for line, _ in data.skipped] == list(range(3, 3 + len(BAD_LINES)))
    for (_, reason), (_, recorded) in zip(BAD_LINES, data.skipped):
        assert reason in recorded


def test_unknown_label_is_fine_without_given_labels(tmp_path):
    data = load_personal(_write(tmp_path, [_row(1), _row(2, "sports")]))
    assert data.labels == ("sports", "work") and data.skipped == []


# --- time split ------------------------------------------------------------------------------------------


def test_time_split_sizes_and_order():
    examples = [_ex(f"m{i:02d}", T0 + i) for i in reversed(range(10))]
    train, evals = time_split(examples, 0.25)
    assert [e.id for e in train] == [f"m{i:02d}" for i in range(7)]
    assert [e.id for e in evals] == ["m07", "m08", "m09"]
    train, evals = time_split(examples, 0.2)
    assert (len(train), len(evals)) == (8, 2)
    assert (len(time_split(examples, 0.01)[1]), len(time_split(examples, 0.99)[0])) == (1, 1)


def test_time_split_moves_boundary_ties_to_eval():
    examples = [_ex("a", T0), _ex("b", T0 + 1), _ex("c", T0 + 2), _ex("d", T0 + 2), _ex("e", T0 + 2), _ex("f", T0 + 3)]
    # asks for 3 eval: d, e, f; c shares d's timestamp
    train, evals = time_split(examples, 0.34)
    assert [e.id for e in train] == ["a", "b"]
    assert [e.id for e in evals] == ["c", "d", "e", "f"]
    assert max(e.timestamp for e in train) < min(e.timestamp for e in evals)


def test_time_split_never_leaks_newer_items_on_sample():
    data = load_personal(SAMPLE)
    for fraction in (0.1, 0.2, 0.5):
        train, evals = time_split(data.examples, fraction)
        assert len(train) + len(evals) == len(data.examples)
        assert max(e.timestamp for e in train) < min(e.timestamp for e in evals)
        assert len(evals) >= len(data.examples) * fraction


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5, True, float("nan"), "0.2"])
def test_time_split_bad_fraction_refused(fraction):
    with pytest.raises(BadInput, match="between 0 and 1"):
        time_split([_ex("a", T0), _ex("b", T0 + 1)], fraction)


def test_time_split_impossible_refused():
    with pytest.raises(BadInput, match="at least 2 examples"):
        time_split([_ex("a", T0)], 0.5)
    with pytest.raises(BadInput, match="strictly older"):
        time_split([_ex("a", T0), _ex("b", T0), _ex("c", T0)], 0.3)


def test_filter_user():
    examples = [_ex("a", T0, user="alex"), _ex("b", T0, user="sam"), _ex("c", T0)]
    assert [e.id for e in filter_user(examples, "alex")] == ["a"]


# --- prompt format ---------------------------------------------------------------------------------------


def test_prompt_round_trips_through_lamp2_split_input():
    labels = ["work", "family", "shopping"]
    text = "message from nora the quarterly report is due friday"
    prompt = format_personal_input(labels, text)
    assert prompt.startswith(PROMPT)
    assert split_input(prompt) == (labels, text)


def test_to_questions_and_encode_example(tokenizer):
    example = _ex("m1", T0, "family", user="alex")
    (question,) = to_questions([example], ("family", "work"))
    assert (question.id, question.user_id, question.output, question.profile) == ("m1", "alex", "family", ())
    assert split_input(question.input) == (["family", "work"], "text m1")
    encoded = encode_example(tokenizer, question.input, question.output, 128)
    target = [t for t, label in zip(encoded["input_ids"], encoded["labels"]) if label != -100]
    assert encoded["labels"][: len(encoded["labels"]) - len(target)] == [-100] * (len(encoded["labels"]) - len(target))
    assert target == tokenizer(" family", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(encoded["input_ids"]).startswith(PROMPT)


# --- the shipped sample (its generator: tools/tests/test_samples.py) -----------------------------------------


def test_shipped_sample_loads_cleanly(tokenizer):
    data = load_personal(SAMPLE)
    assert data.skipped == [] and len(data.labels) >= 5 and len(data.examples) >= 200
    stamps = [e.timestamp for e in data.examples]
    assert stamps == sorted(stamps) and (stamps[-1] - stamps[0]) / 86400 > 13
    for example in data.examples:
        assert 8 <= len(example.text.split()) <= 20 and example.text.isascii() and example.text == example.text.lower()
        ids = tokenizer(example.text)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == example.text
    _, evals = time_split(data.examples, 0.2)
    # the newest items cover every category
    assert set(data.labels) == {e.label for e in evals}
