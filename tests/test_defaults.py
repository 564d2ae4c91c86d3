"""Issue 49's defaults: the schema's are the study's best (upper_path suffix, autocast auto), and the dials that lost or
were never measured live in lcsb.experimental; a recipe that sets one at its old place gets one line naming the new."""

import pytest
import yaml
from helpers import LAMP2, REPO, cli

from lcsb_cli.errors import BadInput
from lcsb_cli.recipe import dump, load_recipe, recipe_from_dict
from lcsb_cli.recipe.schema import MOVED_KEYS, Recipe


def test_the_defaults_are_the_measured_best():
    recipe = Recipe()
    assert (recipe.lcsb.upper_path, recipe.train.autocast) == ("suffix", "auto")
    assert sorted(MOVED_KEYS) == [
        f"lcsb.{name}"
        for name in sorted(("schedule", "exact_above", "idle_update", "lr_scale", "switch_every", "on_return"))
    ]
    assert [name for name in vars(recipe.lcsb)] == ["blocks", "upper_path", "experimental"]


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_moved_key_in_a_recipe_file_is_one_line_naming_its_new_place(tmp_path, old):
    name = old.split(".")[1]
    value = yaml.safe_load(dump(load_recipe(LAMP2)))["lcsb"]["experimental"][name]
    recipe = yaml.safe_load(LAMP2.read_text())
    recipe["lcsb"][name] = value
    recipe["data"] = {k: str((LAMP2.parent / v).resolve()) if "/" in str(v) else v for k, v in recipe["data"].items()}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = cli("validate", str(path))
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert f"{old} moved to lcsb.experimental.{name}" in line


def test_a_moved_key_as_an_override_names_its_new_place_and_the_new_key_works():
    with pytest.raises(BadInput, match=r"lcsb.lr_scale moved to lcsb.experimental.lr_scale"):
        load_recipe(LAMP2, ["lcsb.lr_scale=sqrt_k"])
    assert load_recipe(LAMP2, ["lcsb.experimental.lr_scale=sqrt_k"]).lcsb.experimental.lr_scale == "sqrt_k"


def test_a_run_directorys_config_from_before_the_move_reads_as_it_did():
    raw = yaml.safe_load(dump(load_recipe(LAMP2, ["lcsb.experimental.schedule=random"])))
    old = {**raw, "lcsb": {"blocks": 4, "upper_path": "identity", **raw["lcsb"]["experimental"]}}
    assert "schedule" in old["lcsb"]
    assert recipe_from_dict(old) == recipe_from_dict(raw)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_each_shipped_lcsb_recipe_says_why_its_upper_path(path):
    """The path is the one measured best on the recipe's task, with its reason beside it or on the line above."""
    if load_recipe(path).method != "lcsb":
        return
    lines = path.read_text().splitlines()
    [at] = [i for i, line in enumerate(lines) if "upper_path:" in line]
    assert "#" in lines[at] or lines[at - 1].lstrip().startswith("#"), f"{path.name}: no reason beside upper_path"
