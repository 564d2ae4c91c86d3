"""LaMP-2 evaluation: metrics by hand, scoring against an unpadded reference, retrieval, per-user runs."""

import contextlib
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import LAMP2, REPO, run_train

from lcsb_cli.data import load_task, users
from lcsb_cli.data.lamp2 import (
    TAGS,
    LampQuestion,
    encode_example,
    format_input,
    group_by_user,
    profile_questions,
    retrieve_profile,
)
from lcsb_cli.evaluate import run_eval
from lcsb_cli.evaluate.labels import answer_logprobs, lamp2_metrics, majority_accuracy, score_tags
from lcsb_cli.model.load import inference_mode, load_model
from lcsb_cli.recipe import load_recipe


def test_metrics_by_hand_with_an_unpredicted_label_and_an_out_of_label_answer():
    golds = ["comedy", "comedy", "action", "romance"]
    preds = [" comedy ", "action", "action", "a love story"]
    m = lamp2_metrics(golds, preds)
    assert m["accuracy"] == 0.5 and m["out_of_label"] == 1
    # comedy: tp 1, predicted 1, gold 2 -> F1 2/3; action: tp 1, predicted 2, gold 1 -> 2/3; romance: 0;
    # the 12 labels with no gold and no prediction count 0 (sklearn's zero_division), as LaMP's evaluation.
    assert math.isclose(m["macro_f1"], (2 / 3 + 2 / 3) / 15)
    assert m["per_tag"]["romance"] == {"gold": 1, "predicted": 0, "correct": 0, "f1": 0.0}
    assert m["top_confusions"][0]["count"] == 1


def test_majority_accuracy_answers_the_most_frequent_training_tag():
    assert majority_accuracy(["comedy", "comedy", "action"], ["comedy", "action", "comedy", "sci-fi"]) == 0.5


def _question(description, profile=(), user=None, qid="q1", tags=TAGS, gold="comedy"):
    return LampQuestion(qid, format_input(tags, description), tuple(profile), user, gold)


def test_bm25_retrieval_ranks_by_shared_rare_words():
    profile = [
        {"id": "a", "tag": "romance", "description": "a quiet love story in summer"},
        {"id": "b", "tag": "sci-fi", "description": "a spaceship drifts past jupiter with aliens aboard"},
        {"id": "c", "tag": "action", "description": "a spaceship chase in the city"},
    ]
    question = _question("aliens board a spaceship near jupiter", profile)
    assert [p["id"] for p in retrieve_profile(question, 2)] == ["b", "c"]
    assert retrieve_profile(question, 0) == []


def test_profile_statements_are_dropped_before_the_question_is_cut(tokenizer):
    profile = [{"id": str(i), "tag": "comedy", "description": "slapstick gags " * 6} for i in range(5)]
    text = format_input(list(reversed(TAGS)), "A robot learns to lie on a long voyage.")
    full = encode_example(tokenizer, text, "sci-fi", 512, profile)
    bare = encode_example(tokenizer, text, "sci-fi", 512)
    tight = encode_example(tokenizer, text, "sci-fi", len(bare["input_ids"]) + 10, profile)
    assert len(full["input_ids"]) > len(bare["input_ids"]) + 4 * 20
    # question, tags, answer whole
    assert tight["input_ids"][-len(bare["input_ids"]) :] == bare["input_ids"]
    assert tokenizer.decode(full["input_ids"]).startswith('the tag for the movie: "slapstick')


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "configs" / "tokenizers" / "lcsb-bpe")


def test_users_group_by_user_id_or_by_question():
    timed = [_question("x", user="u1", qid="1"), _question("y", user="u2", qid="2"), _question("z", user="u1", qid="3")]
    assert {k: [q.id for q in v] for k, v in group_by_user(timed).items()} == {"u1": ["1", "3"], "u2": ["2"]}
    untimed = [_question("x", qid="7"), _question("y", qid="8")]
    assert list(group_by_user(untimed)) == ["7", "8"]
    items = [{"id": "p1", "tag": "comedy", "description": "gags"}, {"id": "p2", "tag": "action", "description": "cars"}]
    made = profile_questions(_question("x", items, user="u1"))
    assert [(q.id, q.output, [p["id"] for p in q.profile]) for q in made] == [
        ("p1", "comedy", ["p2"]),
        ("p2", "action", ["p1"]),
    ]


def _with_random_lora(recipe):
    loaded = load_model(recipe, torch.device("cpu"))
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return recipe, loaded


@pytest.fixture(scope="module")
def tiny_model():
    return _with_random_lora(load_recipe(LAMP2, []))


@pytest.fixture(scope="module")
def tiny_nf4():
    return _with_random_lora(load_recipe(LAMP2, ["quantization=nf4"]))


@pytest.mark.parametrize("case", ["adapter", "base", "one-answer-a-pass", "nf4"])
def test_shared_prefix_scores_equal_each_prompt_and_answer_run_whole_and_unpadded(request, monkeypatch, case):
    """Prompts of different lengths (left padding), answers of different lengths (right padding), several answers
    per prompt scored from one KV cache (or one answer a pass, as a large vocabulary makes it), against a full
    forward of each prompt + answer alone; with the adapter, without it, and on 4-bit weights."""
    from lcsb_cli.evaluate import labels

    _recipe, loaded = request.getfixturevalue("tiny_nf4" if case == "nf4" else "tiny_model")
    if case == "one-answer-a-pass":
        monkeypatch.setattr(labels, "LOGITS_BUDGET_BYTES", 1)
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6], [20, 21, 22]]
    rows = [(0, [11, 0]), (0, [12, 13, 14, 0]), (1, [12, 13, 14, 0]), (1, [0]), (1, [11, 0]), (2, [0])]
    adapter = loaded.model.disable_adapter() if case == "base" else contextlib.nullcontext()
    with inference_mode(loaded.model), adapter:
        got = answer_logprobs(loaded.model, prompts, [a for _, a in rows], [o for o, _ in rows], 1, torch.device("cpu"))
        references = []
        for owner, answer in rows:
            prompt = prompts[owner]
            logp = F.log_softmax(loaded.model(input_ids=torch.tensor([prompt + answer])).logits[0, :-1].float(), -1)
            references.append(float(sum(logp[len(prompt) - 1 + j, token] for j, token in enumerate(answer))))
    for score, reference in zip(got.tolist(), references):
        assert math.isclose(score, reference, rel_tol=1e-5, abs_tol=1e-5)
    # each prompt's answers rank alike
    for owner in range(len(prompts)):
        mine = [i for i, (o, _) in enumerate(rows) if o == owner]
        assert sorted(mine, key=lambda i: got[i]) == sorted(mine, key=lambda i: references[i])
    worst = max(abs(a - b) for a, b in zip(got.tolist(), references))
    print(f"{case}: max abs difference against full-prompt scoring: {worst:.2e}")


def test_score_mode_picks_only_from_the_questions_own_tag_list(tiny_model):
    recipe, loaded = tiny_model
    tags = ["comedy", "sci-fi", "dark comedy"]
    question = _question("A robot tells jokes.", tags=tags)
    prompt = encode_example(loaded.tokenizer, question.input, None, 256)["input_ids"]
    with inference_mode(loaded.model):
        [pred] = score_tags(loaded.model, loaded.tokenizer, [question], [prompt], recipe, torch.device("cpu"))
    assert pred in tags


@pytest.fixture(scope="module")
def official_layout(tmp_path_factory):
    """Held-out files in LaMP-2's official time-based layout: the shipped sample's, its held-out questions in reverse
    order (so a run that read the recipe's own files instead would not match them)."""
    path = tmp_path_factory.mktemp("lamp2-heldout")
    for name in ("train_questions.json", "train_outputs.json"):
        shutil.copy(REPO / "recipes" / "data" / "lamp2" / name, path / name)
    for name in ("dev_questions.json", "dev_outputs.json"):
        rows = json.loads((REPO / "recipes" / "data" / "lamp2" / name).read_text())
        if isinstance(rows, dict):
            rows["golds"].reverse()
        else:
            rows.reverse()
        (path / name).write_text(json.dumps(rows))
    dev = json.loads((path / "dev_questions.json").read_text())
    assert all("user_id" in q and all("date" in p for p in q["profile"]) for q in dev)
    return path


def _files(path):
    return [
        f"data.train={path / 'train_questions.json'}",
        f"data.train_labels={path / 'train_outputs.json'}",
        f"data.eval={path / 'dev_questions.json'}",
        f"data.eval_labels={path / 'dev_outputs.json'}",
    ]


@pytest.mark.slow
def test_heldout_files_train_and_evaluate_and_predictions_recompute(tmp_path, official_layout):
    run_dir = tmp_path / "run"
    run_train(run_dir, *_files(official_layout), "train.max_steps=4", "train.eval_every=2", "data.profile_k=2")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [2, 4]
    recipe = load_recipe(run_dir / "config.yaml")
    result = run_eval(recipe, run_dir, run_dir / "adapter", run_dir)
    predictions = json.loads((run_dir / "predictions.json").read_text())
    golds = json.loads((official_layout / "dev_outputs.json").read_text())["golds"]
    assert predictions["task"] == "LaMP_2"
    assert [p["id"] for p in predictions["golds"]] == [g["id"] for g in golds]
    recomputed = lamp2_metrics([g["output"] for g in golds], [p["output"] for p in predictions["golds"]])
    saved = json.loads((run_dir / "eval.json").read_text())
    assert recomputed["accuracy"] == saved["accuracy"] == result["accuracy"]
    assert recomputed["macro_f1"] == saved["macro_f1"]
    assert {"majority_accuracy", "per_tag", "top_confusions"} <= set(saved)
    assert (saved["evaluated"], saved["adapter"], saved["run_dir"]) == (
        f"adapter {run_dir / 'adapter'}",
        str(run_dir / "adapter"),
        str(run_dir),
    )
    assert saved["model"] == recipe.model.name and saved["recipe"]["data"]["profile_k"] == 2
    base = run_eval(recipe, tmp_path / "base")
    assert (base["evaluated"], base["adapter"], base["run_dir"]) == (f"base model {recipe.model.name}", None, None)


def test_generate_mode_writes_stripped_answers(tmp_path):
    result = run_eval(load_recipe(LAMP2, ["eval.mode=generate", "eval.max_new_tokens=3"]), tmp_path)
    predictions = json.loads((tmp_path / "predictions.json").read_text())["golds"]
    assert result["mode"] == "generate" and len(predictions) == result["n"]
    assert all(p["output"] == p["output"].strip() and "\n" not in p["output"] for p in predictions)


@pytest.mark.slow
def test_per_user_runs_train_one_adapter_each_and_report_per_user(tmp_path, official_layout):
    dev = json.loads((official_layout / "dev_questions.json").read_text())
    two_users = sorted({q["user_id"] for q in dev})[:2]
    subset = [q for q in dev if q["user_id"] in two_users]
    (tmp_path / "q.json").write_text(json.dumps(subset))
    golds = json.loads((official_layout / "dev_outputs.json").read_text())
    ids = {q["id"] for q in subset}
    (tmp_path / "o.json").write_text(
        json.dumps({"task": "LaMP_2", "golds": [g for g in golds["golds"] if g["id"] in ids]})
    )
    overrides = [
        f"data.eval={tmp_path / 'q.json'}",
        f"data.eval_labels={tmp_path / 'o.json'}",
        "data.user=all",
        "train.max_steps=2",
        "overnight.report=true",
    ]
    run_dir = tmp_path / "run"
    summary = run_train(run_dir, *overrides)
    assert summary["users"] == 2 and summary["max_steps"] == 4
    for user in two_users:
        assert (run_dir / "adapters" / user / "adapter_model.safetensors").is_file()
        assert (run_dir / "users" / user / "metrics.jsonl").is_file()
    recipe = load_recipe(run_dir / "config.yaml")
    assert list(users(recipe)) == two_users
    result = run_eval(recipe, run_dir, None, run_dir)
    assert set(result["users"]) == set(two_users) and result["n"] == len(subset)
    assert result["evaluated"] == f"per-user adapters in {run_dir / 'adapters'}"
    # overnight.report: the base before, each user's adapter after, in summary.json and report.json/md
    assert summary["eval_after"]["accuracy"] == result["accuracy"] and summary["eval_after"]["n"] == len(subset)
    before = json.loads((run_dir / "eval-before" / "eval.json").read_text())
    assert before["evaluated"] == f"base model {recipe.model.name}"
    assert summary["eval_before"]["accuracy"] == before["accuracy"] == run_eval(recipe, tmp_path / "base")["accuracy"]
    assert json.loads((run_dir / "summary.json").read_text())["eval_before"] == summary["eval_before"]
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["steps"], report["max_steps"], report["eval_after"]) == (4, 4, summary["eval_after"])
    assert "before training" in (run_dir / "report.md").read_text()
    assert [result["users"][u]["adapter"] for u in two_users] == [str(run_dir / "adapters" / u) for u in two_users]
    # one base, adapters swapped in: the same as loading the base with each user's adapter afresh
    swapped = {g["id"]: g["output"] for g in json.loads((run_dir / "predictions.json").read_text())["golds"]}
    for user in two_users:
        alone = run_eval(
            load_recipe(run_dir / "config.yaml", [f"data.user={user}"]), tmp_path / user, run_dir / "adapters" / user
        )
        assert alone["n"] == result["users"][user]["n"] > 0
        assert alone["loss"] == pytest.approx(result["users"][user]["loss"], abs=1e-6)
        reloaded = json.loads((tmp_path / user / "predictions.json").read_text())["golds"]
        assert {g["id"]: g["output"] for g in reloaded} == {g["id"]: swapped[g["id"]] for g in reloaded}


def test_cli_eval_without_a_terminal_prints_each_pass_with_its_rate(tmp_path):
    import re

    from helpers import cli

    proc = cli("eval", str(LAMP2), "--output", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == ["held-out loss", "score mode"]
    assert all(re.fullmatch(r"[a-z -]+: 90 items in [0-9.]+ s \([0-9.]+/s\)", line) for line in lines), lines


def test_every_pass_reports_its_progress_up_to_its_item_count(tiny_model):
    import io

    from rich.console import Console

    from lcsb_cli.display import Phases
    from lcsb_cli.evaluate import evaluate_items

    recipe, loaded = tiny_model
    # batch 8: two batches a pass
    questions = load_task(recipe, loaded.tokenizer).need_held_out()[:10]
    told: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def recording(what, n):
        told[what] = [n]
        yield told[what].append

    evaluate_items(loaded.model, loaded.tokenizer, questions, recipe, TAGS, recording)
    assert told == {"held-out loss": [10, 8, 2], "score mode": [10, 8, 2]}

    screen = io.StringIO()
    phases = Phases(Console(file=screen, force_terminal=True, width=100))
    with phases("score mode", 10) as advance:
        advance(8)
        advance(2)
    assert "10/10" in screen.getvalue() and "/s" in screen.getvalue()
    # the bar gone, the line stays
    assert "score mode: 10 items in" in screen.getvalue().rstrip().splitlines()[-1]
