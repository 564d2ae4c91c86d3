"""The nightly lineage (`lcsb night`) on lamp-tiny and the shipped phone-labels sample: the first 40 items are night
1's data, the next 40 arrive for night 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, cli, kill_after_step
from safetensors.torch import load_file

from lcsb_cli.data.personal import load_personal
from lcsb_cli.data.records import item_hash, personal_record
from lcsb_cli.run import lineage

SAMPLE = REPO / "recipes" / "data" / "personal" / "movies.jsonl"
ARGS = ("backend=cpu", "train.max_steps=4", "train.batch_size=4", "train.save_every=2", "lineage.passes=0")


def night(root, data, *extra):
    return cli("night", "overnight", f"data.train={data}", *ARGS, *extra, "--output", str(root))


def ran(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def same_lineage(a, b):
    """lineage.json (but for training's wall time and the job's history of it), every night's adapter and the served
    one."""

    def state(root):
        data = json.loads((root / "lineage.json").read_text())
        for record in data["nights"]:
            record.pop("train_time_s")
            record.pop("job")
        return data

    assert state(a) == state(b)
    assert os.readlink(a / "adapter") == os.readlink(b / "adapter")
    for adapter in sorted(a.glob("nights/*/run/adapter/adapter_model.safetensors")):
        theirs = load_file(b / adapter.relative_to(a))
        assert all((t == theirs[k]).all() for k, t in load_file(adapter).items()), adapter


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Data files: night 1's 40 items, then with night 2's 40 more; a lineage after night 1 and one after night 2."""
    root = tmp_path_factory.mktemp("lineage")
    lines = SAMPLE.read_text().splitlines(keepends=True)
    first, second = root / "day1.jsonl", root / "day2.jsonl"
    first.write_text("".join(lines[:40]))
    second.write_text("".join(lines[:80]))
    ran(night(root / "after1", first))
    shutil.copytree(root / "after1", root / "after2", symlinks=True)
    ran(night(root / "after2", second))
    return root, first, second


def copy_of(days, name, tmp_path):
    shutil.copytree(days[0] / name, tmp_path / "lineage", symlinks=True)
    return tmp_path / "lineage"


def test_a_night_on_unchanged_data_changes_nothing(days, tmp_path):
    _, _, second = days
    lineage_dir = copy_of(days, "after2", tmp_path)
    before = (lineage_dir / "lineage.json").read_bytes()
    assert ran(night(lineage_dir, second)) == "no new items since night 2; the promoted adapter stays " + (
        "nights/002/run/adapter"
    )
    assert (lineage_dir / "lineage.json").read_bytes() == before
    assert sorted(p.name for p in (lineage_dir / "nights").iterdir()) == ["001", "002"]


def test_new_items_are_found_and_old_ones_not_relearned(days):
    root, first, second = days
    old = {item_hash(e) for e in load_personal(first).examples}
    new = {item_hash(e) for e in load_personal(second).examples} - old
    plan = json.loads((root / "after2" / "nights" / "002" / "plan.json").read_text())
    state1 = lineage.read_state(root / "after1")
    assert set(plan["new"]) == new and len(new) == 40
    # trained: night 1's held-out items, tonight's older new items, and replayed items learned before (not the probe)
    fresh = plan["train"][: len(plan["learned"])]
    assert fresh == state1["carried"] + plan["train_new"]
    replayed = set(plan["train"][len(fresh) :])
    assert len(replayed) == plan["replay"] > 0
    assert replayed <= set(state1["learned"]) - set(state1["probe"])
    assert not set(plan["train_new"]) & old


def test_a_regressing_night_is_not_promoted_and_the_previous_adapter_is_served(days, tmp_path):
    _, _, second = days
    lineage_dir = copy_of(days, "after1", tmp_path)
    line = ran(night(lineage_dir, second, "train.lr=0.3"))
    state = lineage.read_state(lineage_dir)
    record = state["nights"][-1]
    assert not record["promoted"] and record["after"]["held_out"] < record["before"]["held_out"]
    assert state["current"] == "nights/001/run/adapter" == os.readlink(lineage_dir / "adapter")
    assert line.endswith("not promoted, kept nights/001/run/adapter")
    assert f"held_out accuracy {record['before']['held_out']:.3f} -> {record['after']['held_out']:.3f}" in line


def crash_at(monkeypatch, name):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt(f"killed at {name}")

    monkeypatch.setattr(lineage, name, crash)


@pytest.mark.parametrize("phase", ["_scores", "_train_night", "promote", "_write_report"])
def test_a_night_cut_at_any_phase_ends_as_an_uninterrupted_one(days, tmp_path, monkeypatch, phase):
    """Cut before the evaluations, before training, before the promotion's replace, and after it."""
    root, _, second = days
    lineage_dir = copy_of(days, "after1", tmp_path)
    with monkeypatch.context() as patched:
        crash_at(patched, phase)
        with pytest.raises(KeyboardInterrupt):
            lineage.night(*_night_args(lineage_dir, second))
    ran(night(lineage_dir, second))
    same_lineage(root / "after2", lineage_dir)


def test_kill_9_during_training_then_the_same_command_ends_identical(days, tmp_path):
    root, _, second = days
    lineage_dir = copy_of(days, "after1", tmp_path)
    command = [sys.executable, "-m", "lcsb_cli", "night", "overnight", f"data.train={second}", *ARGS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [*command, "--output", str(lineage_dir)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    kill_after_step(proc, lineage_dir / "nights" / "002" / "run", 3)
    ran(night(lineage_dir, second))
    same_lineage(root / "after2", lineage_dir)


def _night_args(root, data):
    from lcsb_cli.paths import recipe_file
    from lcsb_cli.recipe import load_recipe
    from lcsb_cli.run.hooks import SilentDisplay

    return load_recipe(recipe_file("overnight"), [f"data.train={data}", *ARGS]), root, SilentDisplay()


def test_items_after_the_watermark_are_new_and_an_unseen_older_line_is_late(days):
    """New by timestamp: newer than the newest item learned; an unseen line at or before it (backfilled) is late."""
    from dataclasses import replace

    root, _, second = days
    state = lineage.read_state(root / "after2")
    examples = load_personal(second).examples
    assert state["watermark"] == max(e.timestamp for e in examples)
    backfilled = replace(examples[5], id="backfilled", timestamp=examples[5].timestamp + 1)
    later = [replace(examples[0], id=f"later-{i}", timestamp=state["watermark"] + 60 * i) for i in range(1, 4)]
    recipe, _, _ = _night_args(root, second)
    plan = lineage._plan(recipe, state, [personal_record(e) for e in (*examples, backfilled, *later)], True)
    assert plan["new"] == [item_hash(e) for e in (backfilled, *later)] and plan["late"] == 1
    assert plan["newest"] == later[-1].timestamp


def two_users(tmp_path, user="sam"):
    """The sample's first 40 items, every other one the second user's."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:40]]
    for row in rows[1::2]:
        row["user"] = user
    path = tmp_path / "users.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_data_user_all_gives_each_user_a_lineage(tmp_path):
    data = two_users(tmp_path)
    proc = night(tmp_path / "lineages", data, "data.user=all", "train.max_steps=2")
    ran(proc)
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["alex", "sam"] and all(": night 1: 20 new" in x for x in lines)
    examples = load_personal(data).examples
    for user in ("alex", "sam"):
        state = lineage.read_state(tmp_path / "lineages" / "users" / user)
        assert set(state["seen"]) == {item_hash(e) for e in examples if e.user == user}
        assert state["current"] == "nights/001/run/adapter"


def test_data_user_all_refuses_a_user_id_that_is_a_path(tmp_path):
    data = two_users(tmp_path, user="../sam")
    proc = night(tmp_path / "lineages", data, "data.user=all")
    assert proc.returncode == 2 and "user id '../sam' cannot name a lineage dir" in proc.stderr
    assert not (tmp_path / "lineages" / "users").exists()


def test_a_night_runs_on_npu_sim(days, tmp_path):
    """The overnight recipe as shipped (backend npu-sim; lineage.passes 1: one pass over the 32 items trained)."""
    _, first, _ = days
    proc = cli("night", "overnight", f"data.train={first}", "--output", str(tmp_path / "npu"))
    line = ran(proc)
    assert line.startswith("night 1: 40 new items") and "trained on 32 (0 replayed)" in line
    run = tmp_path / "npu" / "nights" / "001" / "run"
    assert "backend: npu-sim" in (run / "config.yaml").read_text()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in steps if "loss" in row]
    # batch 8
    assert [row["step"] for row in steps] == [1, 2, 3, 4] and all("sim_step_time_s" in row for row in steps)
    assert lineage.read_state(tmp_path / "npu")["nights"][0]["job"] == {
        "throttled_s": 0.0,
        "waited_s": 0.0,
        "interruptions": 0,
        "resumes": 0,
    }


@pytest.mark.parametrize("method", ["full-backprop", "freeze", "lisa", "mezo"])
def test_a_night_warm_started_from_the_last_trains_with_every_method(days, tmp_path, method):
    """Night 1 trained with lcsb; night 2, from its promoted adapter, with another method."""
    _, _, second = days
    lineage_dir = copy_of(days, "after1", tmp_path)
    assert ran(night(lineage_dir, second, f"method={method}")).startswith("night 2: 40 new items")
    run = lineage_dir / "nights" / "002" / "run"
    assert json.loads((run / "summary.json").read_text())["method"] == method
    assert f"init: {lineage_dir / 'nights' / '001' / 'run' / 'adapter'}" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_nights_on_a_packed_gguf_base(days, tmp_path):
    """Two nights on a Q8_0 file kept packed (`quantization: gguf`), the second warm-started from the first (the
    random-init base learns nothing, so any night is promoted: tolerance 1)."""
    from gguf_families import family_file

    _, first, second = days
    source = family_file("llama", "Q8_0")
    args = (
        f"model.name={source}",
        "quantization=gguf",
        "lcsb.blocks=2",
        "lineage.tolerance=1",
        "train.check_initial_loss=false",
    )
    assert ran(night(tmp_path / "lineage", first, *args)).startswith("night 1: 40 new items")
    assert ran(night(tmp_path / "lineage", second, *args)).startswith("night 2: 40 new items")
    config = (tmp_path / "lineage" / "nights" / "002" / "run" / "config.yaml").read_text()
    assert "quantization: gguf" in config and "nights/001/run/adapter" in config
