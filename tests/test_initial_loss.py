"""train.check_initial_loss: a fresh run whose loss on its first batch is worse than a uniform guess over the
vocabulary stops with one line (exit 2) before any step: such a model is broken, not untrained. The shipped
random-init presets start near ln(vocab) and pass."""

import math
import re
import shutil

import pytest
import torch
import yaml
from helpers import LAMP2, cli, run_train
from transformers import AutoConfig, AutoModelForCausalLM

from lcsb_cli.model import load as models


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory):
    """tiny-qwen2's shape drawn with std 1 instead of 0.02: confident and wrong, its first loss far above ln(vocab)."""
    spec = yaml.safe_load((models.PRESET_DIR / "tiny-qwen2.yaml").read_text())
    path = tmp_path_factory.mktemp("broken")
    torch.manual_seed(0)
    config = AutoConfig.for_model(spec["architecture"], **spec["config"], initializer_range=1.0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models.TOKENIZER_DIR / spec["tokenizer"] / name, path / name)
    return path


def test_a_first_loss_above_the_uniform_guess_stops_the_run_in_one_line(broken_model, tmp_path):
    result = cli("train", str(LAMP2), f"model.name={broken_model}", "train.max_steps=2", "--output", str(tmp_path))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    bound = math.log(4096) + 1
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1], result.stderr
    loss = float(re.search(r"its loss on the first batch, ([\d.]+), is above", errors[0])[1])
    assert loss > bound and f"ln(vocab_size) + 1 = {bound:.2f}" in errors[0]
    assert "train.check_initial_loss=false" in errors[0] and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    # checked in the set-up: the run dir was never claimed, no step ran
    assert not any(tmp_path.iterdir())


def test_a_broken_model_forced_over_a_run_leaves_that_run_alone(broken_model, tmp_path):
    run_train(tmp_path, "train.max_steps=1")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = cli("train", str(LAMP2), f"model.name={broken_model}", "--force", "--output", str(tmp_path))
    assert result.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == before


def test_with_the_check_off_the_broken_model_trains(broken_model, tmp_path):
    summary = run_train(tmp_path, f"model.name={broken_model}", "train.max_steps=2", "train.check_initial_loss=false")
    assert summary["steps"] == 2 and summary["final_loss"] > math.log(4096) + 1


@pytest.mark.parametrize("preset", ["tiny-qwen2", "bench-qwen2"])
def test_the_shipped_random_init_presets_pass_the_check(preset, tmp_path):
    assert run_train(tmp_path, f"model.name={preset}", "train.max_steps=1")["steps"] == 1
