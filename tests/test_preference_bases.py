"""Preference objectives on the bases and starts users bring (issue 51): the adapter-off reference pass on an nf4 base
and on the packed GGUF file, a warm start's adapter as its own reference, and conversational pairs rendered with the
base's chat template in a trained run.

A fresh adapter (B = 0) computes exactly what its reference computes, so a DPO run's first loss is ln 2 wherever the
reference pass is right; a reference that is not the policy's starting point moves it off ln 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import REPO, run_train

from lcsb_cli.data import load_task
from lcsb_cli.model.load import load_model
from lcsb_cli.objectives import reference
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import read_metrics

PREFS = REPO / "tests" / "tiny_prefs.yaml"
PAIRS = REPO / "recipes" / "data" / "prefs" / "pairs_train.jsonl"
LN2 = math.log(2)


def first_rows(tmp_path, count: int):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(PAIRS.read_text().splitlines()[:count]) + "\n")
    return path


def first_loss(run_dir) -> float:
    return read_metrics(run_dir / "metrics.jsonl")[0]["loss"]


def test_the_reference_pass_runs_on_an_nf4_base(tmp_path):
    run_train(
        tmp_path / "run", "quantization=nf4", "train.max_steps=2", f"data.train={first_rows(tmp_path, 8)}", recipe=PREFS
    )
    assert first_loss(tmp_path / "run") == pytest.approx(LN2, abs=1e-5)
    table = reference.load_reference(tmp_path / "run", 8)
    assert table.shape == (8, 2) and bool(torch.isfinite(table).all()) and bool((table < 0).all())


@pytest.mark.slow
@pytest.mark.xdist_group("gguf-packed")
def test_the_reference_pass_runs_on_the_packed_gguf_base(tmp_path):
    """SmolLM2's Q4_1 file trained as its blocks: the reference comes from the same packed layers, adapter off."""
    run_train(
        tmp_path / "run",
        "model.name=smollm2-135m",
        "quantization=gguf",
        "lora.targets=all-linear",
        "train.batch_size=1",
        "train.max_steps=1",
        f"data.train={first_rows(tmp_path, 2)}",
        recipe=PREFS,
    )
    assert first_loss(tmp_path / "run") == pytest.approx(LN2, abs=1e-4)
    assert reference.load_reference(tmp_path / "run", 2).shape == (2, 2)


def test_a_warm_start_takes_its_starting_adapter_as_the_reference(tmp_path):
    data = f"data.train={first_rows(tmp_path, 8)}"
    run_train(tmp_path / "first", data, "train.max_steps=4", "train.lr=1e-2", recipe=PREFS)
    run_train(tmp_path / "warm", data, "train.max_steps=1", f"lora.init={tmp_path / 'first'}", recipe=PREFS)
    # the policy starts at its reference, though the first run moved it off the base
    assert first_loss(tmp_path / "warm") == pytest.approx(LN2, abs=1e-5)
    assert first_loss(tmp_path / "first") == pytest.approx(LN2, abs=1e-5)
    assert read_metrics(tmp_path / "first" / "metrics.jsonl")[-1]["loss"] < LN2 - 0.01
    base, warm = (reference.load_reference(tmp_path / name, 8) for name in ("first", "warm"))
    assert not torch.allclose(base, warm, atol=1e-3)


def test_conversational_pairs_train_with_the_bases_chat_template(tmp_path):
    """lamp-tiny's template renders the turns; the prompt ids are the template's up to its generation prompt and the
    targets are what the assistant's turn adds, in a run that trains."""
    record = {
        "prompt": [{"role": "user", "content": "are we on for tonight?"}],
        "chosen": [{"role": "assistant", "content": "yep!"}],
        "rejected": [{"role": "assistant", "content": "Dear Sam, I confirm our appointment."}],
    }
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(record) for _ in range(4)) + "\n")
    overrides = ["model.name=lamp-tiny", "lora.targets=all-linear", f"data.train={path}", "data.eval=null"]
    # lamp-tiny knows movie blurbs, not this text: the first-batch check would refuse it (tests/test_initial_loss.py)
    overrides.append("train.check_initial_loss=false")
    recipe = load_recipe(PREFS, overrides)
    tokenizer = load_model(recipe, torch.device("cpu")).tokenizer
    row = load_task(recipe, tokenizer).train[0]
    prompt = tokenizer.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(row["prompt_ids"]) == prompt and prompt.endswith("<|assistant|>\n")
    assert tokenizer.decode(row["chosen_ids"]).startswith("yep!<|endoftext|>")
    summary = run_train(tmp_path / "run", *overrides, "train.max_steps=2", recipe=PREFS)
    assert summary["steps"] == 2 and first_loss(tmp_path / "run") == pytest.approx(LN2, abs=1e-5)
