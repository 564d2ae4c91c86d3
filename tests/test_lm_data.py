"""text, completion and chat data: the loss masks, the held-out split, bad lines, and the metrics they are scored by."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import LAMP2, REPO, assert_one_line_error, cli, run_train
from rouge_score import rouge_scorer

from lcsb_cli.data import load_task
from lcsb_cli.data.lm import load_lm_split
from lcsb_cli.errors import BadInput
from lcsb_cli.evaluate import run_eval
from lcsb_cli.evaluate.text import held_out_loss, text_metrics
from lcsb_cli.model.load import load_model, load_tokenizer, materialize_preset
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import read_metrics

EOS = "<|endoftext|>"
DATA = REPO / "recipes" / "data"
NO_LABELS = ["data.eval=null", "data.train_labels=null", "data.eval_labels=null"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(materialize_preset("tiny-qwen2"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_completion_loss_covers_the_completion_and_eos_only(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"id": "q1", "prompt": "Question: the dog?\nAnswer:", "completion": " Biscuit"}]
    )
    [row] = load_lm_split(path, "completion", tokenizer, 64, "error").rows
    prompt = ids(tokenizer, "Question: the dog?\nAnswer:")
    target = ids(tokenizer, " Biscuit") + [tokenizer.eos_token_id]
    assert row["input_ids"] == prompt + target
    assert row["labels"] == [-100] * len(prompt) + target
    assert (row["id"], row["prompt_ids"], row["reference"]) == ("q1", prompt, "Biscuit")


def test_chat_loss_covers_the_assistant_turns_and_their_end_of_turn_only(tmp_path, tokenizer):
    """The built-in tokenizer's template renders `<|role|>\\ncontent<|endoftext|>\\n` per turn."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My dog?"},
        {"role": "assistant", "content": "Biscuit."},
        {"role": "user", "content": "My cafe?"},
        {"role": "assistant", "content": "Little Fern."},
    ]
    [row] = load_lm_split(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}]), "chat", tokenizer, 256, "error"
    ).rows
    pieces = [
        ("<|system|>\nBe brief." + EOS + "\n<|user|>\nMy dog?" + EOS + "\n<|assistant|>\n", False),
        ("Biscuit." + EOS + "\n", True),
        ("<|user|>\nMy cafe?" + EOS + "\n<|assistant|>\n", False),
        ("Little Fern." + EOS + "\n", True),
    ]
    expected_ids = [t for text, _ in pieces for t in ids(tokenizer, text)]
    expected_labels = [t if target else -100 for text, target in pieces for t in ids(tokenizer, text)]
    assert row["input_ids"] == expected_ids
    assert row["labels"] == expected_labels
    assert row["prompt_ids"] == ids(tokenizer, "".join(text for text, _ in pieces[:3]))
    assert row["reference"] == "Little Fern."


def test_text_documents_end_with_eos_and_pack_into_windows_with_every_token_a_target(tmp_path, tokenizer):
    (tmp_path / "t.txt").write_text("First document,\nstill the first.\n\nSecond one.\n\n\nThird.\n")
    rows = load_lm_split(str(tmp_path / "t.txt"), "text", tokenizer, 8, "error").rows
    eos = [tokenizer.eos_token_id]
    stream = (
        ids(tokenizer, "First document,\nstill the first.")
        + eos
        + ids(tokenizer, "Second one.")
        + eos
        + ids(tokenizer, "Third.")
        + eos
    )
    assert [row["input_ids"] for row in rows] == [stream[i : i + 8] for i in range(0, len(stream), 8)]
    assert all(row["labels"] == row["input_ids"] for row in rows)


def test_the_held_out_fraction_is_the_same_on_every_run_and_disjoint_from_training(tokenizer):
    args = ["data.format=completion", f"data.train={DATA / 'qa' / 'train.jsonl'}", *NO_LABELS]
    first = load_task(load_recipe(LAMP2, [*args, "train.seed=0"]), tokenizer)
    second = load_task(load_recipe(LAMP2, [*args, "train.seed=7"]), tokenizer)
    assert [r["id"] for r in first.held_out] == [r["id"] for r in second.held_out]
    train_ids, held_ids = {r["id"] for r in first.train}, {r["id"] for r in first.held_out}
    assert not train_ids & held_ids and len(held_ids) == round(0.2 * (len(train_ids) + len(held_ids)))


BAD = [
    ("completion", ['{"prompt": "a", "completion": " b"}', "{not json"], 2, "not valid JSON"),
    ("completion", ['{"prompt": "a"}'], 1, '"completion" must be a non-empty string'),
    ("completion", [{"prompt": "word " * 80, "completion": " b"}], 1, "leaves no room for the completion"),
    ("chat", [{"messages": [{"role": "user", "content": "hi"}]}], 1, "no assistant turn"),
    (
        "chat",
        [{"messages": [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]}],
        1,
        "no assistant token falls within data.max_length",
    ),
    ("text", ['{"text": ""}'], 1, '"text" must be a non-empty string'),
]


@pytest.mark.parametrize("fmt, lines, line, message", BAD)
def test_a_bad_line_is_named_or_skipped_and_counted(tmp_path, tokenizer, fmt, lines, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(BadInput, match=rf"data\.jsonl: line {line}: .*{message}.*on_bad_line=skip"):
        load_lm_split(path, fmt, tokenizer, 32, "error")
    good = {
        "completion": {"prompt": "a", "completion": " b"},
        "text": {"text": "fine"},
        "chat": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    }[fmt]
    split = load_lm_split(write_jsonl(tmp_path / "mixed.jsonl", [good, *lines]), fmt, tokenizer, 32, "skip")
    assert [number for number, _ in split.skipped] == [line + 1] and len(split.rows) == 1 + (len(lines) > 1)


def test_an_empty_file_and_a_file_of_bad_lines_are_refused(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(BadInput, match="empty.jsonl: the file is empty"):
        load_lm_split(str(tmp_path / "empty.jsonl"), "completion", tokenizer, 32, "error")
    with pytest.raises(BadInput, match=r"no usable chat example \(1 bad lines\)"):
        load_lm_split(write_jsonl(tmp_path / "bad.jsonl", ['{"messages": []}']), "chat", tokenizer, 32, "skip")


def test_bad_data_exits_2_with_one_line_and_no_traceback(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    result = cli(
        "train", str(LAMP2), "--output", str(tmp_path / "run"), "data.format=chat", f"data.train={path}", *NO_LABELS
    )
    assert "line 1: the conversation has no assistant turn" in assert_one_line_error(result)
    assert not (tmp_path / "run").exists()


def test_perplexity_is_exp_of_the_mean_target_token_nll(tokenizer):
    recipe = load_recipe(
        LAMP2, ["data.format=chat", f"data.train={DATA / 'chat' / 'eval.jsonl'}", "data.max_length=96", *NO_LABELS]
    )
    loaded = load_model(recipe, torch.device("cpu"))
    rows = load_task(recipe, loaded.tokenizer).held_out[:5]
    measured = held_out_loss(loaded.model, rows, loaded.tokenizer.pad_token_id, batch_size=2)
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = loaded.model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            nll += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    assert measured["target_tokens"] == count
    assert measured["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert measured["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_exact_match_and_rouge_agree_with_rouge_score_called_directly():
    refs = ["Your dog is Biscuit. — Pip", "Line 14", "Tomas", "on Mondays and Thursdays"]
    outs = ["Your dog is Biscuit. — Pip", " Line 41", "Your partner is Tomas", "Mondays"]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"])
    direct = [scorer.score(r, o) for r, o in zip(refs, outs)]
    metrics = text_metrics(refs, outs)
    assert metrics["exact_match"] == 0.25
    assert metrics["rouge1"] == pytest.approx(sum(s["rouge1"].fmeasure for s in direct) / 4)
    assert metrics["rougeL"] == pytest.approx(sum(s["rougeL"].fmeasure for s in direct) / 4)
    assert 0 < metrics["rougeL"] < 1


def test_eval_of_a_completion_run_writes_generation_metrics_and_predictions(tmp_path):
    recipe = load_recipe(
        LAMP2,
        [
            "data.format=completion",
            f"data.train={DATA / 'qa' / 'train.jsonl'}",
            f"data.eval={DATA / 'qa' / 'eval.jsonl'}",
            "data.train_labels=null",
            "data.eval_labels=null",
            "data.max_length=64",
            "eval.max_new_tokens=4",
        ],
    )
    result = run_eval(recipe, tmp_path)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written == result and written["n"] == 60
    assert {"exact_match", "rouge1", "rougeL", "loss", "perplexity"} <= set(written)
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    expected = [json.loads(line)["id"] for line in (DATA / "qa" / "eval.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions["golds"]] == expected
    assert all(isinstance(p["output"], str) for p in predictions["golds"])


@pytest.mark.slow
def test_periodic_eval_and_the_overnight_report_carry_the_formats_metrics(tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        run_dir,
        "data.format=chat",
        f"data.train={DATA / 'chat' / 'train.jsonl'}",
        f"data.eval={DATA / 'chat' / 'eval.jsonl'}",
        "data.train_labels=null",
        "data.eval_labels=null",
        "data.max_length=96",
        "eval.max_new_tokens=4",
        "train.max_steps=2",
        "train.eval_every=2",
        "overnight.report=true",
    )
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in row]
    assert len(rows) == 1 and rows[0]["step"] == 2
    assert {"eval_perplexity", "eval_exact_match", "eval_rouge1", "eval_rougeL"} <= set(rows[0])
    report = json.loads((run_dir / "report.json").read_text())
    assert report["eval_after"]["loss"] == pytest.approx(rows[0]["eval_loss"])
    assert report["eval_before"]["loss"] > report["eval_after"]["loss"]
    header = "| held-out items | exact_match | rouge1 | rougeL | loss | perplexity |"
    assert header in (run_dir / "report.md").read_text()


def test_chat_needs_a_tokenizer_with_a_chat_template(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(BadInput, match="chat needs a tokenizer with a chat template"):
        load_lm_split(path, "chat", tokenizer, 32, "error")
