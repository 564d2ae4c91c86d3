"""LaMP-2 loading/encoding, batching and the shipped sample (its generator: tools/tests/test_samples.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import itertools

import pytest
import torch

from lcsb_cli.data.batching import BatchStream, collate
from lcsb_cli.data.lamp2 import (
    TAGS,
    encode_example,
    format_input,
    lamp2_dataset,
    load_lamp2,
    split_input,
)
from lcsb_cli.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "recipes" / "data" / "lamp2"
SAMPLE_FILES = ("train_questions.json", "train_outputs.json", "dev_questions.json", "dev_outputs.json")
DESCRIPTION = "Mara, a shy nurse from Lisbon, boards a battered spaceship bound for a distant planet. " * 4


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ROOT / "configs" / "tokenizers" / "lcsb-bpe"))


def _write(tmp_path: Path, questions, golds) -> tuple[Path, Path]:
    qpath, opath = tmp_path / "q.json", tmp_path / "o.json"
    qpath.write_text(json.dumps(questions))
    opath.write_text(json.dumps({"task": "LaMP_2", "golds": golds}))
    return qpath, opath


def _questions(n: int = 3) -> list[dict]:
    return [
        {
            "id": str(i),
            "input": format_input(TAGS, f"movie {i}"),
            "user_id": "u",
            "profile": [{"id": f"p{i}", "tag": "comedy", "description": "x"}],
        }
        for i in range(n)
    ]


# --- parsing and loading -------------------------------------------------------------------------


def test_split_input_keeps_shuffled_order():
    tags = list(reversed(TAGS))
    parsed, description = split_input(format_input(tags, "A robot learns to lie."))
    assert parsed == tags
    assert description == "A robot learns to lie."


@pytest.mark.parametrize(
    "text", ["no tags here description: x", "tags: [comedy, action] no desc", "tags: [comedy, action description: x"]
)
def test_split_input_rejects_malformed(text):
    with pytest.raises(ValueError):
        split_input(text)


def test_loader_joins_golds_by_id(tmp_path):
    golds = [{"id": "2", "output": "action"}, {"id": "0", "output": "sci-fi"}, {"id": "1", "output": "comedy"}]
    questions = load_lamp2(*_write(tmp_path, _questions(), golds))
    assert [(q.id, q.output) for q in questions] == [("0", "sci-fi"), ("1", "comedy"), ("2", "action")]
    assert questions[0].user_id == "u" and questions[0].profile[0]["tag"] == "comedy"
    assert all(q.output is None for q in load_lamp2(tmp_path / "q.json"))


def test_loader_rejects_missing_gold(tmp_path):
    qpath, opath = _write(tmp_path, _questions(), [{"id": "0", "output": "sci-fi"}, {"id": "2", "output": "action"}])
    with pytest.raises(BadInput, match=r"o\.json: no gold for question id '1'"):
        load_lamp2(qpath, opath)


def test_loader_rejects_gold_outside_tags(tmp_path):
    golds = [{"id": "0", "output": "sci-fi"}, {"id": "1", "output": "horror"}, {"id": "2", "output": "action"}]
    with pytest.raises(BadInput, match=r"o\.json: gold id '1' .*'horror' is not one of the 15"):
        load_lamp2(*_write(tmp_path, _questions(), golds))


def test_loader_rejects_truncated_json(tmp_path):
    qpath = tmp_path / "train_questions.json"
    qpath.write_text((SAMPLE / "train_questions.json").read_text()[:5000])
    with pytest.raises(BadInput, match=r"train_questions\.json: invalid JSON at line \d+, column \d+"):
        load_lamp2(qpath)


def test_loader_rejects_bad_question_input_and_duplicates(tmp_path):
    questions = _questions()
    questions[1]["input"] = "what tag? description: x"
    with pytest.raises(BadInput, match=r"q\.json: question id '1' \(index 1\).*tags: \["):
        load_lamp2(_write(tmp_path, questions, [])[0])
    questions = _questions()
    questions[2]["id"] = "0"
    with pytest.raises(BadInput, match=r"question id '0' appears twice \(index 2\)"):
        load_lamp2(_write(tmp_path, questions, [])[0])


# --- encoding ------------------------------------------------------------------------------------


def _labeled_text(tokenizer, example: dict) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != -100])


def test_encode_matches_joint_tokenization_and_labels(tokenizer):
    text = format_input(TAGS, "A wizard in an enchanted forest.")
    example = encode_example(tokenizer, text, "based on a book", 512)
    joint = tokenizer(text + "\nAnswer: based on a book", add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == joint + [tokenizer.eos_token_id]
    assert _labeled_text(tokenizer, example) == " based on a book<|endoftext|>"
    n_labeled = sum(t != -100 for t in example["labels"])
    assert example["labels"][-n_labeled:] == example["input_ids"][-n_labeled:]


def test_encode_truncates_only_the_description(tokenizer):
    tags = list(reversed(TAGS))
    text = format_input(tags, DESCRIPTION)
    full = encode_example(tokenizer, text, "twist ending", 4096)
    example = encode_example(tokenizer, text, "twist ending", len(full["input_ids"]) - 20)
    assert len(example["input_ids"]) == len(full["input_ids"]) - 20
    prompt = tokenizer.decode([i for i, label in zip(example["input_ids"], example["labels"]) if label == -100])
    head, kept = prompt.split("description:")
    assert head.endswith(f"tags: [{', '.join(tags)}] ")
    assert kept.endswith("\nAnswer:")
    kept = kept[: -len("\nAnswer:")]
    assert kept and (" " + DESCRIPTION).startswith(kept) and len(kept) < len(DESCRIPTION)
    assert _labeled_text(tokenizer, example) == " twist ending<|endoftext|>"


def test_encode_minimum_length_error(tokenizer):
    text = format_input(TAGS, DESCRIPTION)
    head = text[: text.index("description:") + len("description:")]
    pieces = (head, "\nAnswer:", " sci-fi")
    # + eos
    minimum = sum(len(tokenizer(piece, add_special_tokens=False)["input_ids"]) for piece in pieces) + 1
    at_minimum = encode_example(tokenizer, text, "sci-fi", minimum)
    assert len(at_minimum["input_ids"]) == minimum
    assert tokenizer.decode(at_minimum["input_ids"]).endswith("description:\nAnswer: sci-fi<|endoftext|>")
    with pytest.raises(BadInput, match=rf"max_length={minimum - 1} is too small.*at least {minimum}"):
        encode_example(tokenizer, text, "sci-fi", minimum - 1)


def test_encode_without_target_is_the_prompt(tokenizer):
    text = format_input(TAGS, DESCRIPTION)
    with_target = encode_example(tokenizer, text, "comedy", 4096)
    prompt = encode_example(tokenizer, text, None, 4096)
    assert set(prompt["labels"]) == {-100}
    assert prompt["input_ids"] == with_target["input_ids"][: len(prompt["input_ids"])]
    assert tokenizer.decode(prompt["input_ids"]).endswith("\nAnswer:")


def test_lamp2_dataset_columns(tokenizer):
    questions = load_lamp2(SAMPLE / "dev_questions.json", SAMPLE / "dev_outputs.json")[:5]
    dataset = lamp2_dataset(tokenizer, questions, 256)
    assert all(set(row) == {"input_ids", "labels"} for row in dataset) and len(dataset) == 5
    assert _labeled_text(tokenizer, dataset[0]) == f" {questions[0].output}<|endoftext|>"
    with pytest.raises(BadInput, match=f"question id '{questions[0].id}': max_length=10"):
        lamp2_dataset(tokenizer, questions, 10)


# --- batching ------------------------------------------------------------------------------------


def test_collate_pads_right():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate(rows, pad_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_rounds_the_width_up_to_the_multiple():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    assert collate(rows, pad_id=1, multiple=3)["input_ids"].shape == (2, 3)
    batch = collate(rows, pad_id=1, multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [8, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]


def test_the_trained_batches_pad_to_the_recipes_multiple(tokenizer):
    from helpers import LAMP2

    from lcsb_cli.data import build_train_batches
    from lcsb_cli.recipe import load_recipe

    widths = {}
    for multiple in (1, 32):
        recipe = load_recipe(LAMP2, ["data.user=null", f"data.pad_to_multiple_of={multiple}"])
        stream = build_train_batches(recipe, tokenizer)
        widths[multiple] = [stream.batch(i)["input_ids"].shape[1] for i in range(8)]
    assert all(w % 32 == 0 for w in widths[32]) and any(w % 32 for w in widths[1])
    assert [-(-w // 32) * 32 for w in widths[1]] == widths[32]


def _rows(n: int) -> list[dict]:
    return [{"input_ids": [i] * (1 + i % 3), "labels": [i] * (1 + i % 3)} for i in range(n)]


def test_batch_stream_is_a_pure_function_of_the_index():
    late = BatchStream(_rows(10), batch_size=4, seed=7, pad_id=0)
    # out of order, across epochs
    late_batches = {i: late.batch(i) for i in (9, 3, 0)}
    for i, batch in late_batches.items():
        fresh = BatchStream(_rows(10), batch_size=4, seed=7, pad_id=0).batch(i)
        assert all(torch.equal(batch[k], fresh[k]) for k in batch)
    other = BatchStream(_rows(10), batch_size=4, seed=8, pad_id=0)
    assert [other.indices(i) for i in range(5)] != [late.indices(i) for i in range(5)]


def test_batch_stream_covers_each_epoch_once():
    stream = BatchStream(_rows(10), batch_size=4, seed=3, pad_id=0)
    # 40 positions = 4 epochs
    order = [i for b in range(10) for i in stream.indices(b)]
    epochs = [order[e * 10 : (e + 1) * 10] for e in range(4)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1)).tolist()
    assert epochs[1] == expected
    # positions 8..11 straddle epochs 0 and 1
    assert stream.batch(2)["input_ids"].shape[0] == 4


def test_batch_stream_batch_larger_than_dataset():
    stream = BatchStream(_rows(3), batch_size=7, seed=0, pad_id=0)
    order = [i for b in range(3) for i in stream.indices(b)]
    assert all(sorted(order[e * 3 : (e + 1) * 3]) == [0, 1, 2] for e in range(7))


# --- the shipped sample and its generator -------------------------------------------------------


def test_sample_files_load_with_golds_in_tags():
    train = load_lamp2(SAMPLE / "train_questions.json", SAMPLE / "train_outputs.json")
    dev = load_lamp2(SAMPLE / "dev_questions.json", SAMPLE / "dev_outputs.json")
    assert len(train) >= 250 and len(dev) >= 60
    assert all(q.output in TAGS for q in train + dev)
    assert {q.user_id for q in dev} <= {q.user_id for q in train} and len({q.user_id for q in train}) >= 20
    for q in train + dev:
        tags, description = split_input(q.input)
        assert sorted(tags) == sorted(TAGS)
        assert 20 <= len(description.split()) <= 40
        assert 10 <= len(q.profile) <= 20
    profiles = {q.user_id: q.profile for q in train}
    profile_ids = [p["id"] for profile in profiles.values() for p in profile]
    assert len(profile_ids) == len(set(profile_ids))
    assert all(p["date"] < later["date"] for profile in profiles.values() for p, later in itertools.pairwise(profile))
    assert sum((SAMPLE / name).stat().st_size for name in SAMPLE_FILES) < 2_000_000
