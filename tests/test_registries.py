"""The registries: one entry per data format and per method the recipe accepts, and every format honours data.eval."""

from pathlib import Path

from helpers import REPO

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
