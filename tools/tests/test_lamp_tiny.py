"""The built-in pretrained base: its build script runs, and its corpus never holds the sample's eval items."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic import pretrain_documents

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_build_script_runs_a_few_steps_and_writes_a_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "lamp-tiny"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/build/build_lamp_tiny.py",
            "--steps",
            "2",
            "--docs",
            "60",
            "--batch",
            "2",
            "--length",
            "64",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    card = (out / "MODEL_CARD.md").read_text()
    assert "final loss" in card and "--steps 2" in card
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 8 and all(
        d % 32 == 0 for d in (model.config.hidden_size, model.config.intermediate_size)
    )
    assert AutoTokenizer.from_pretrained(out)("a robot")["input_ids"]


def test_pretraining_corpus_is_deterministic_and_never_holds_the_sample_items():
    docs = pretrain_documents(0, 3000)
    assert docs == pretrain_documents(0, 3000)
    corpus = "\n".join(docs)
    sample = REPO / "recipes" / "data" / "lamp2"
    questions = json.loads((sample / "dev_questions.json").read_text())
    descriptions = [q["input"].split("description: ", 1)[1] for q in questions]
    descriptions += [p["description"] for q in questions for p in q["profile"]]
    assert not [d for d in descriptions if d in corpus]
