"""Warm start (`lora.init`): a run trains on from another run's adapter, with a fresh optimizer.

Equality that must hold: on data of one item (every batch the same), the warm run's first loss is the loss the longer
single run logs at that step, bit for bit: the same weights meet the same batch. What differs after it is the
optimizer (AdamW's moments and bias correction start again) and the LR schedule (it starts again at step 0; here
constant, so only the moments differ). A warm run does not continue the source's data cursor: its batches are its
own run's, from batch 0.
"""

import json
import shutil

import pytest
import yaml
from helpers import LAMP2, adapter_tensors, assert_one_line_error, assert_same_tensors, cli, run_train

from lcsb_cli.recipe import dump, load_recipe, replace_key
from lcsb_cli.rundir import read_metrics

CONSTANT = ("method=full-backprop", "train.lr_scheduler=constant", "train.warmup_steps=0", "train.lr=1e-2")


@pytest.fixture(scope="module")
def one_item(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "one.txt"
    path.write_text("the movie follows a nurse who sings through a musical about friends and rivals\n")
    return ("data.format=text", f"data.train={path}", "data.max_length=64", f"data.eval={path}") + tuple(
        f"data.{k}=null" for k in ("train_labels", "eval_labels")
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_item):
    root = tmp_path_factory.mktemp("warm")
    args = (*CONSTANT, *one_item, "train.save_every=2")
    run_train(root / "first", *args, "train.max_steps=4")
    run_train(root / "long", *args, "train.max_steps=8")
    run_train(root / "warm", *args, "train.max_steps=4", f"lora.init={root / 'first'}")
    return root, args


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


def test_a_warm_start_continues_the_weights_with_a_fresh_optimizer(runs):
    root, _ = runs
    long, warm = losses(root / "long"), losses(root / "warm")
    # the first 4 steps of the long run are the first run's (constant LR): the warm run starts from step 4's weights
    assert losses(root / "first") == long[:4]
    assert warm[0] == long[4]
    # fresh AdamW moments: the next step moves the weights elsewhere
    assert warm[1] != long[5]


def test_the_starting_adapter_is_recorded(runs):
    root, _ = runs
    config = yaml.safe_load((root / "warm" / "config.yaml").read_text())
    summary = json.loads((root / "warm" / "summary.json").read_text())
    assert config["lora"]["init"] == str(root / "first")
    assert len(config["lora"]["init_sha256"]) == 64
    assert summary["init"] == {"path": str(root / "first"), "user": None, "sha256": config["lora"]["init_sha256"]}
    assert summary["base"] == json.loads((root / "first" / "summary.json").read_text())["base"]


def test_a_resumed_warm_run_ends_bit_identical_without_reading_the_source_again(runs, tmp_path):
    root, args = runs
    source = tmp_path / "source"
    shutil.copytree(root / "first", source)
    run_train(tmp_path / "resumed", *args, "train.max_steps=2", f"lora.init={source}")
    pinned = yaml.safe_load((tmp_path / "resumed" / "config.yaml").read_text())["lora"]["init_sha256"]
    shutil.rmtree(source)
    run_train(tmp_path / "resumed", *args, "train.max_steps=4", f"lora.init={source}", resume=True)
    assert_same_tensors(adapter_tensors(tmp_path / "resumed"), adapter_tensors(root / "warm"))
    assert yaml.safe_load((tmp_path / "resumed" / "config.yaml").read_text())["lora"]["init_sha256"] == pinned


@pytest.mark.parametrize(
    "change, needles",
    [
        (("model.name=lamp-tiny",), ("tiny-qwen2", "lamp-tiny")),
        (("lora.rank=8",), ("rank 16", "rank 8")),
        (("lora.targets=[q_proj,v_proj]",), ("gate_proj", "q_proj, v_proj")),
        (("lora.alpha=8",), ("alpha 32", "alpha 8")),
    ],
)
def test_another_base_or_lora_shape_is_refused_naming_both(runs, tmp_path, change, needles):
    root, args = runs
    out = tmp_path / "out"
    proc = cli("train", str(LAMP2), *args, "train.max_steps=1", f"lora.init={root / 'first'}", *change, "--output", out)
    assert_one_line_error(proc, "lora.init", *needles)
    assert not out.exists()


def test_a_per_user_run_needs_the_user(tmp_path):
    per_user = tmp_path / "per-user"
    (per_user / "adapters" / "alex").mkdir(parents=True)
    (per_user / "config.yaml").write_text(dump(replace_key(load_recipe(LAMP2), "data.user", "all")))
    proc = cli("train", str(LAMP2), f"lora.init={per_user}", "--output", str(tmp_path / "out"))
    assert_one_line_error(proc, str(per_user), "per-user run", "alex", "lora.init_user")
    proc = cli("train", str(LAMP2), f"lora.init={per_user}", "lora.init_user=sam", "--output", str(tmp_path / "out"))
    assert_one_line_error(proc, "no adapter for user 'sam'", "alex")


def test_a_changed_pinned_adapter_is_refused(runs, tmp_path):
    root, args = runs
    proc = cli(
        "train", str(LAMP2), *args, f"lora.init={root / 'first'}", "lora.init_sha256=" + "ab" * 32, "--output",
        str(tmp_path / "out"),
    )  # fmt: skip
    assert_one_line_error(proc, str(root / "first"), "abababababababab", "pinned")


def test_an_exported_adapter_gguf_starts_where_its_run_ended(runs, tmp_path):
    root, args = runs
    gguf = tmp_path / "first.gguf"
    exported = cli("export", str(root / "first"), "--format", "gguf", "--outtype", "f32", "--output", str(gguf))
    assert exported.returncode == 0, exported.stderr
    run_train(tmp_path / "from-gguf", *args, "train.max_steps=1", f"lora.init={gguf}")
    assert losses(tmp_path / "from-gguf")[0] == pytest.approx(losses(root / "warm")[0], rel=1e-6)
