"""The registries: one entry per data format and per method the recipe accepts, every format honours data.eval,
and each method names its own bench labels."""

from pathlib import Path

import pytest
from helpers import LAMP2, REPO

from lcsb_cli.data import FORMATS, load_task
from lcsb_cli.recipe import CHOICES, load_recipe

OVERNIGHT = REPO / "recipes" / "overnight.yaml"
MOVIES = REPO / "recipes" / "data" / "personal" / "movies.jsonl"


def test_the_recipe_accepts_exactly_the_registered_formats():
    assert tuple(CHOICES["data.format"]) == tuple(FORMATS)


def test_jsonl_trains_on_all_of_data_train_and_holds_out_data_eval(tmp_path: Path):
    """Before the registry, jsonl ignored data.eval and held out the newest fifth of data.train instead."""
    lines = MOVIES.read_text().splitlines()
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join(lines[:7]) + "\n")
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(lines[7:]) + "\n")
    recipe = load_recipe(OVERNIGHT, [f"data.train={train}", f"data.eval={held_out}", "data.on_bad_line=error"])
    task = load_task(recipe, tokenizer=None)
    assert [q.id for q in task.train] == [line.split('"')[3] for line in lines[7:]]
    assert [q.id for q in task.held_out] == [line.split('"')[3] for line in lines[:7]]


def test_jsonl_without_data_eval_holds_out_the_newest(tmp_path: Path):
    task = load_task(load_recipe(OVERNIGHT, []), tokenizer=None)
    # ids grow with the timestamp
    assert max(q.id for q in task.train) < min(q.id for q in task.held_out)
    assert len(task.held_out) / (len(task.train) + len(task.held_out)) >= 0.2


def test_the_registry_is_typed_for_evaluation():
    assert {name for name, f in FORMATS.items() if f.labelled} == {"lamp2", "jsonl"}
    assert {name for name, f in FORMATS.items() if f.generative} == {"completion", "chat"}


def test_the_recipe_accepts_exactly_the_registered_methods():
    from lcsb_cli.methods import METHODS

    assert tuple(CHOICES["method"]) == tuple(METHODS)


# one label per form (tests/tiny.yaml runs lcsb:4 on the identity path)
LABELS = (
    "lcsb:2:identity",
    "lcsb:3:exact",
    "lcsb:4:suffix",
    "full-backprop",
    "full-backprop+ckpt",
    "freeze",
    "lisa",
    "mezo",
)


@pytest.mark.parametrize("label", LABELS)
def test_every_method_label_round_trips_through_its_recipe(label):
    from lcsb_cli.methods import label_of, recipe_for_label

    assert label_of(recipe_for_label(label, load_recipe(LAMP2))) == label


def test_a_label_sets_the_keys_its_variant_names():
    from lcsb_cli.methods import blocks_of, label_of, recipe_for_label

    recipe = load_recipe(LAMP2, ["activation_checkpointing=true"])
    exact = recipe_for_label("lcsb:3:exact", recipe)
    own = recipe_for_label("lcsb:2", load_recipe(LAMP2, ["lcsb.upper_path=exact"]))
    assert (exact.lcsb.blocks, exact.lcsb.upper_path) == (3, "exact")
    assert (own.lcsb.blocks, own.lcsb.upper_path, label_of(own)) == (2, "exact", "lcsb:2:exact")
    suffix = recipe_for_label("lcsb:2:suffix", recipe)
    assert (suffix.lcsb.blocks, suffix.lcsb.upper_path, label_of(suffix)) == (2, "suffix", "lcsb:2:suffix")
    assert not recipe_for_label("full-backprop", recipe).activation_checkpointing
    labels = ("lcsb:3:exact", "lcsb:12", "full-backprop", "lcsb:2@lora.rank=8")
    assert [blocks_of(label) for label in labels] == [3, 12, None, None]


@pytest.mark.parametrize(
    "label", ["lcsb", "lcsb:0", "lcsb:4:exactly", "lcsb:4:exact-1", "lcsb:4:suffix2", "full-backprop+ckpt2", "sgd"]
)
def test_a_label_no_method_has_is_refused(label):
    from lcsb_cli.methods import recipe_for_label

    assert recipe_for_label(label, load_recipe(LAMP2)) is None


def test_an_unknown_compare_label_lists_every_form():
    from lcsb_cli.bench.compare import method_names
    from lcsb_cli.errors import BadInput

    with pytest.raises(BadInput) as refused:
        method_names(load_recipe(LAMP2), ["lcsb:4:exactly"])
    assert str(refused.value) == (
        "--compare: unknown method 'lcsb:4:exactly'; choose from lcsb:K, lcsb:K:suffix, lcsb:K:exact, "
        "lcsb:K:identity, full-backprop, full-backprop+ckpt, freeze, lisa, mezo, hf-trainer, hf-trainer:bf16, "
        "each optionally with @KEY=VALUE[,KEY=VALUE]"
    )
