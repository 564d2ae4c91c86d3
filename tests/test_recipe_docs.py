"""The recipe is documented in one place, its dataclasses: every key has help, `lcsb validate --explain` prints it
with the allowed values, the shipped recipes' comments agree with it, and a data key the format does not read is
an error naming it."""

import re

import pytest
from helpers import LAMP2, REPO, cli

from lcsb_cli.recipe import CHOICES, Recipe
from lcsb_cli.recipe.parse import fields_of

SHIPPED = sorted((REPO / "recipes").glob("**/*.yaml"))
LINE = re.compile(r"^(?P<indent>\s*)(?P<key>\w+):(?P<value>[^#]*)#(?P<comment>.*)$")


def test_every_key_has_help_and_explain_prints_each_with_its_choices():
    keys = list(fields_of(Recipe))
    assert all(f.metadata.get("help") for _, f, _ in keys)
    proc = cli("validate", str(LAMP2), "--explain")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(":", 1)[0]: line for line in proc.stdout.splitlines()}
    assert set(lines) == {dotted for dotted, _, _ in keys}
    assert "[cpu | cuda | npu-sim | npu-htp]" in lines["backend"] and "[>= 1]" in lines["lcsb.blocks"]


def enumerated_comments(path):
    """(dotted key, comment) of each `key: value  # a | b | c` line whose comment lists a choice key's values."""
    section = None
    for line in path.read_text().splitlines():
        match = LINE.match(line)
        if not line.startswith((" ", "#")) and line.strip():
            section = line.split(":", 1)[0]
        if match is None:
            continue
        dotted = f"{section}.{match['key']}" if match["indent"] else match["key"]
        if dotted in CHOICES and " | " in match["comment"]:
            yield dotted, match["comment"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_a_shipped_recipe_that_lists_a_keys_values_lists_them_all(path):
    for dotted, comment in enumerated_comments(path):
        missing = [
            value for value in CHOICES[dotted] if not re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", comment)
        ]
        assert not missing, f"{path.name}: {dotted}'s comment lacks {missing}: {comment!r}"


def test_the_comment_check_sees_a_stale_list(tmp_path):
    stale = tmp_path / "stale.yaml"
    stale.write_text("backend: cpu                # cpu | cuda\nlcsb:\n  upper_path: suffix  # suffix | exact\n")
    assert [key for key, _ in enumerated_comments(stale)] == ["backend", "lcsb.upper_path"]


@pytest.mark.parametrize(
    "fmt,override,unused",
    [
        ("jsonl", "data.profile_k=3", "data.profile_k"),
        ("text", "data.train_labels=x.json", "data.train_labels"),
        ("completion", "data.labels=[a, b]", "data.labels"),
        ("chat", "data.eval_labels=x.json", "data.eval_labels"),
        ("lamp2", "data.on_bad_line=skip", "data.on_bad_line"),
        ("lamp2", "data.eval_fraction=0.3", "data.eval_fraction"),
    ],
)
def test_a_data_key_the_format_does_not_read_is_an_error(fmt, override, unused):
    own = [] if fmt == "lamp2" else ["data.train_labels=null", "data.eval_labels=null", "data.user=null"]
    proc = cli("validate", str(LAMP2), f"data.format={fmt}", *own, override)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.startswith(f"error: {unused}: format {fmt} does not use it"), proc.stderr
    # the way out it names works where the key cannot be removed (set in a recipe file, its format overridden)
    suggested = re.search(r"override it with its default \((\S+)\)", proc.stderr)[1]
    assert suggested.startswith(f"{unused}=")
    assert cli("validate", str(LAMP2), f"data.format={fmt}", *own, suggested).returncode == 0
