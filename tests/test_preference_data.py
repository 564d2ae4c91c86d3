"""The preference and feedback formats (data/preference.py): TRL's conventions read unchanged (strings and chat lists,
JSONL and parquet), truncation keeps the response whole and cuts the prompt from the left, the loss covers the
response only; and every bad input of issue 51 is one line, exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, assert_one_line_error, cli, snapshot

from lcsb_cli.data import build_train_batches, load_task
from lcsb_cli.model.load import load_model
from lcsb_cli.recipe import load_recipe

PREFS = REPO / "tests" / "tiny_prefs.yaml"
PAIR = {"prompt": "Reply to Sam: are we on?", "chosen": "yep!", "rejected": "Dear Sam, I confirm our meeting."}


@pytest.fixture(scope="module")
def tokenizer():
    import torch

    return load_model(load_recipe(PREFS), torch.device("cpu")).tokenizer


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def recipe_for(train: Path, *overrides: str):
    return load_recipe(PREFS, [f"data.train={train}", "data.eval=null", *overrides])


def test_truncation_cuts_the_prompt_from_the_left_and_keeps_both_responses(tmp_path, tokenizer):
    long_prompt = " ".join(f"word{i}" for i in range(200))
    path = write_jsonl(tmp_path / "p.jsonl", [{**PAIR, "prompt": long_prompt}] * 3)
    recipe = recipe_for(path, "data.max_length=48")
    task = load_task(recipe, tokenizer)
    batch = build_train_batches(recipe, tokenizer, task).batch(0)
    rejected = tokenizer(PAIR["rejected"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    row = batch["input_ids"][2]
    labels = batch["labels"][2]
    targets = labels[labels != -100].tolist()
    assert targets == rejected, "the rejected response must be whole and the only targets"
    assert int(batch["attention_mask"][2].sum()) <= 48
    prompt_tail = tokenizer(long_prompt, add_special_tokens=False)["input_ids"][-5:]
    assert row[: int(batch["attention_mask"][2].sum())].tolist()[-len(rejected) - 5 : -len(rejected)] == prompt_tail
    # the chosen row keeps the same prompt tokens (cut for the longer response)
    chosen_prompt = batch["input_ids"][0][batch["labels"][0] == -100][: 48 - len(rejected)]
    assert chosen_prompt.tolist() == row[: 48 - len(rejected)].tolist()


def test_chat_lists_render_with_the_template(tmp_path, tokenizer):
    if not getattr(tokenizer, "chat_template", None):
        pytest.skip("the tiny preset's tokenizer has no chat template")
    record = {
        "prompt": [{"role": "user", "content": "are we on?"}],
        "chosen": [{"role": "assistant", "content": "yep!"}],
        "rejected": [{"role": "assistant", "content": "Dear Sam, I confirm."}],
    }
    path = write_jsonl(tmp_path / "c.jsonl", [record] * 3)
    task = load_task(recipe_for(path), tokenizer)
    assert tokenizer.decode(task.train[0]["chosen_ids"]).startswith("yep!")


def test_parquet_reads_like_jsonl(tmp_path, tokenizer):
    import pandas

    rows = [{**PAIR, "chosen": f"yep {i}"} for i in range(4)]
    pandas.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    from_parquet = load_task(recipe_for(tmp_path / "p.parquet"), tokenizer)
    from_jsonl = load_task(recipe_for(write_jsonl(tmp_path / "p.jsonl", rows)), tokenizer)
    assert [r["chosen_ids"] for r in from_parquet.train] == [r["chosen_ids"] for r in from_jsonl.train]


BAD_PAIRS = {
    "no rejected": ([{"prompt": "hi", "chosen": "yo"}], ('"rejected"', "line 1")),
    "a number": ([{**PAIR, "chosen": 3}], ('"chosen"', "string or a list")),
    "chosen equals rejected": ([{**PAIR, "chosen": "same", "rejected": "same"}], ("equals",)),
    "response too long": ([{**PAIR, "rejected": "word " * 400}], ("rejected response", "data.max_length=96")),
}


@pytest.mark.parametrize("case", BAD_PAIRS)
def test_bad_preference_lines(tmp_path, case):
    rows, needles = BAD_PAIRS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [PAIR, *rows] if case != "no rejected" else rows)
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    proc = cli("train", str(PREFS), f"data.train={path}", "data.eval=null", "--output", str(out))
    assert_one_line_error(proc, *needles)
    assert snapshot(tmp_path) == before and not out.exists()


@pytest.mark.parametrize("label", [True, False])
def test_kto_refuses_feedback_of_one_kind(tmp_path, label):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}", "label": label} for i in range(5)]
    path = write_jsonl(tmp_path / "fb.jsonl", rows)
    proc = cli(
        "train", str(PREFS), "objective=kto", "data.format=feedback", f"data.train={path}", "data.eval=null",
        "--output", str(tmp_path / "out"),
    )  # fmt: skip
    assert_one_line_error(proc, "all 5", str(label).lower(), "kto")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (("objective=sft",), ("sft", "preference")),
        (("objective=dpo", "data.format=completion"), ("dpo", "preference", "completion")),
        (("objective=dpo", "data.format=chat"), ("dpo", "chat")),
        (("objective=kto",), ("kto", "feedback")),
        (("data.packing=true",), ("data.packing", "preference")),
    ],
)
def test_objective_and_format_must_agree(tmp_path, overrides, needles):
    proc = cli("train", str(PREFS), *overrides, "--output", str(tmp_path / "out"))
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()
