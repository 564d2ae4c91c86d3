"""train.check_initial_loss: a fresh run whose loss on its first batch is worse than a uniform guess over the
vocabulary stops with one line (exit 2) before any step. The line tells a broken model from a sound base that does
not know the text (lamp-tiny on a user's own messages). The shipped random-init presets start near ln(vocab) and
pass."""

import json
import math
import random
import re
import shutil
from datetime import datetime, timedelta, timezone

import pytest
import torch
import yaml
from helpers import LAMP2, REPO, assert_one_line_error, cli, run_train
from safetensors.torch import load_file, save_file
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
    assert loss > bound and f"ln(vocab_size) + 1 = {bound:.2f}" in errors[0] and "the model is broken" in errors[0]
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


# what one person's phone showed in a week, filed into six folders: wording lamp-tiny's movie corpus never had
NOTIFICATIONS = {
    "work": (
        "Slack: Priya mentioned you in #launch-plan",
        "Standup moved to 10:30, same Zoom link",
        "Jira: PROJ-214 was assigned to you",
        "Calendar: 1:1 with Marcus in 15 minutes",
    ),
    "bills": (
        "Venmo: you paid Jordan $18.50 for pizza",
        "Your Verizon autopay of $64.12 is scheduled",
        "Chase: a $230.00 charge at Costco was approved",
        "PayPal: refund of $12.99 issued",
    ),
    "deliveries": (
        "Amazon: your package was delivered to the porch",
        "DoorDash: Dasher is approaching with your order",
        "UPS: delivery window 2pm-6pm today",
        "Instacart: shopper is picking your groceries",
    ),
    "health": (
        "Fitbit: you hit 10,000 steps today!",
        "Reminder: take vitamin D with breakfast",
        "Walgreens: your prescription is ready for pickup",
        "Dr. Okafor's office confirmed Thursday 9am",
    ),
    "social": (
        "Maya reacted to your story",
        "Instagram: 3 new followers",
        "WhatsApp: Tio Ruben sent a photo",
        "Group chat: who's in for tacos Friday?",
    ),
    "news": (
        "Breaking: storm warning issued for the coast",
        "NYT: markets slip as rates hold steady",
        "ESPN: Warriors edge Lakers in overtime",
        "Weather: 70% chance of rain after 4pm",
    ),
}


@pytest.fixture(scope="module")
def my_week(tmp_path_factory):
    """Seven days of eight labelled notifications in the documented jsonl format (id, text, label, timestamp, user)."""
    rng, start = random.Random(0), datetime(2027, 3, 1, 7, tzinfo=timezone.utc)
    lines = []
    for n in range(7 * 8):
        label = rng.choice(sorted(NOTIFICATIONS))
        when = start + timedelta(days=n // 8, minutes=rng.randrange(16 * 60))
        item = {
            "id": f"n{n:03d}",
            "text": rng.choice(NOTIFICATIONS[label]),
            "label": label,
            "timestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "user": "sam",
        }
        lines.append(json.dumps(item))
    path = tmp_path_factory.mktemp("week") / "my_week.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def scrambled_lamp_tiny(tmp_path_factory):
    """lamp-tiny with its (tied) embedding rows shuffled among the tokens: every weight as trained, but each token
    read and predicted through another's vector, as a checkpoint saved beside the wrong vocabulary would be."""
    path = tmp_path_factory.mktemp("scrambled")
    shutil.copytree(models.PRESET_DIR / "lamp-tiny", path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    rows = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def train_overnight(data, output, *overrides):
    """The shipped overnight recipe as a new user runs it on their own file."""
    return cli(
        "train", str(REPO / "recipes" / "overnight.yaml"), f"data.train={data}", *overrides, "--output", str(output)
    )


def test_the_demo_base_on_a_users_own_messages_names_the_text_and_the_way_out(my_week, tmp_path):
    error = assert_one_line_error(
        train_overnight(my_week, tmp_path / "run"),
        "lamp-tiny does not know this text",
        "model.name=smollm2-135m",
        "recipes/overnight-smollm2.yaml",
        "train.check_initial_loss=false",
    )
    assert "broken" not in error
    loss = float(re.search(r"its loss on the first batch, ([\d.]+), is above", error)[1])
    sample = float(re.search(r"yet ([\d.]+) on the shipped movie sample", error)[1])
    lacking = int(re.search(r"(\d+)% of the batch's words are not in its vocabulary", error)[1])
    assert loss > math.log(1856) + 1 > math.log(1856) - 1 > sample and lacking >= 30, error
    assert not (tmp_path / "run").exists()


def test_a_scrambled_model_on_the_same_messages_is_still_broken(my_week, scrambled_lamp_tiny, tmp_path):
    result = train_overnight(my_week, tmp_path / "run", f"model.name={scrambled_lamp_tiny}")
    error = assert_one_line_error(result, "model.name: the model is broken", "train.check_initial_loss=false")
    sample = float(re.search(r"and ([\d.]+) on the shipped movie sample", error)[1])
    assert sample > math.log(1856) and "does not know" not in error
    assert not (tmp_path / "run").exists()
