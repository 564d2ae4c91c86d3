"""The nightly lineage beyond phone labels (issue 50): chat, completion, text, preference and feedback data, ordered
by their records' timestamps when every record has one, else by the file's order and each record's content hash."""

import json
import shutil
from types import SimpleNamespace

import pytest
from helpers import REPO, cli

from lcsb_cli.data.records import read_records
from lcsb_cli.errors import BadInput
from lcsb_cli.run import lineage

TINY = (
    "backend=cpu",
    "train.max_steps=4",
    "train.batch_size=4",
    "train.save_every=2",
    "train.check_initial_loss=false",
    "lineage.passes=0",
)
CHAT = REPO / "recipes" / "data" / "chat" / "train.jsonl"
PAIRS = REPO / "recipes" / "data" / "prefs" / "pairs_train.jsonl"


def night(root, data, *extra):
    proc = cli("night", "overnight", f"data.train={data}", "data.labels=null", *TINY, *extra, "--output", str(root))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def timed_chats(count):
    """The chat sample's first `count` conversations, an hour apart, the newest first in the file."""
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()[:count]]
    return [{**row, "timestamp": f"2026-11-{1 + i // 24:02d}T{i % 24:02d}:00:00Z"} for i, row in enumerate(rows)][::-1]


def data_section(path, fmt, columns=None):
    return SimpleNamespace(format=fmt, train=str(path), on_bad_line="error", labels=None, columns=columns)


@pytest.fixture(scope="module")
def chat_nights(tmp_path_factory):
    """Night 1 on 12 timed conversations, then night 2 with 12 newer ones (file order reversed: time decides)."""
    root = tmp_path_factory.mktemp("chat")
    first = write_jsonl(root / "day1.jsonl", timed_chats(24)[12:])
    second = write_jsonl(root / "day2.jsonl", timed_chats(24))
    lines = [night(root / "lineage", first, "data.format=chat")]
    lines.append(night(root / "lineage", second, "data.format=chat"))
    return root, first, second, lines


def test_chat_nights_take_the_conversations_newer_than_the_watermark(chat_nights):
    root, first, second, lines = chat_nights
    old = {r.hash for r in read_records(data_section(first, "chat")).items}
    newer = {r.hash for r in read_records(data_section(second, "chat")).items} - old
    plan = json.loads((root / "lineage" / "nights" / "002" / "plan.json").read_text())
    assert set(plan["new"]) == newer and len(newer) == 12
    assert not set(plan["train_new"]) & old
    assert plan["range"] == ["2026-11-01T12:00:00Z", "2026-11-01T23:00:00Z"]
    state = lineage.read_state(root / "lineage")
    assert [record["metric"] for record in state["nights"]] == ["loss", "loss"]
    assert "held_out loss" in lines[1] and "(2026-11-01T12:00:00Z .. 2026-11-01T23:00:00Z)" in lines[1]


def test_a_chat_night_on_unchanged_data_changes_nothing(chat_nights, tmp_path):
    root, _, second, _ = chat_nights
    lineage_dir = tmp_path / "lineage"
    shutil.copytree(root / "lineage", lineage_dir, symlinks=True)
    before = (lineage_dir / "lineage.json").read_bytes()
    line = night(lineage_dir, second, "data.format=chat")
    assert line == "no new items since night 2; the promoted adapter stays nights/002/run/adapter"
    assert (lineage_dir / "lineage.json").read_bytes() == before


def test_a_night_scored_by_loss_is_promoted_only_if_the_loss_did_not_rise_beyond_the_tolerance():
    assert lineage.promotes("loss", {"held_out": 2.0, "probe": 1.0}, {"held_out": 1.5, "probe": 1.09}, 0.1)
    assert not lineage.promotes("loss", {"held_out": 2.0, "probe": 1.0}, {"held_out": 1.5, "probe": 1.11}, 0.1)
    assert lineage.promotes("accuracy", {"held_out": 0.5}, {"held_out": 0.45}, 0.05)
    assert not lineage.promotes("accuracy", {"held_out": 0.5}, {"held_out": 0.44}, 0.05)


def test_preference_pairs_without_timestamps_are_new_by_content(tmp_path):
    """Pairs with no timestamp: the appended ones (and an edited one) are new, in the file's order; the same file
    again is a no-op."""
    lines = PAIRS.read_text().splitlines(keepends=True)
    first = tmp_path / "day1.jsonl"
    first.write_text("".join(lines[:12]))
    edited = json.loads(lines[0])
    edited["chosen"] = edited["chosen"] + " :)"
    second = tmp_path / "day2.jsonl"
    second.write_text(json.dumps(edited) + "\n" + "".join(lines[1:24]))
    args = ("data.format=preference", "objective=dpo")
    assert night(tmp_path / "lineage", first, *args).startswith("night 1: 12 new items, trained on 9")
    line = night(tmp_path / "lineage", second, *args)
    assert line.startswith("night 2: 13 new items, trained on") and "held_out accuracy" in line
    plan = json.loads((tmp_path / "lineage" / "nights" / "002" / "plan.json").read_text())
    records = read_records(data_section(second, "preference")).items
    assert plan["new"] == [records[0].hash] + [r.hash for r in records[12:]]
    assert plan["range"] is None and lineage.read_state(tmp_path / "lineage")["watermark"] is None
    assert night(tmp_path / "lineage", second, *args).startswith("no new items since night 2")


def test_records_read_timestamps_from_a_parquet_file_and_keep_its_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    from datetime import datetime, timezone

    rows = {
        "question": ["a?", "b?", "c?"],
        "answer": ["x", "y", "z"],
        "timestamp": [datetime(2026, 11, day, tzinfo=timezone.utc) for day in (3, 1, 2)],
    }
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "qa.parquet"))
    found = read_records(
        data_section(tmp_path / "qa.parquet", "completion", {"prompt": "question", "completion": "answer"})
    )
    assert found.timed and [r.timestamp for r in found.items] == [
        datetime(2026, 11, day, tzinfo=timezone.utc).timestamp() for day in (3, 1, 2)
    ]
    assert [r.row["question"] for r in found.items] == ["a?", "b?", "c?"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("data.format=chat",), '23 of 24 records have a "timestamp"; a lineage orders by time only when every record'),
        (("data.format=lamp2", "data.on_bad_line=error"), "a lineage reads jsonl, chat, completion, text, preference"),
    ],
)
def test_data_a_lineage_cannot_order_is_refused_in_one_line(tmp_path, args, message):
    rows = timed_chats(24)
    del rows[5]["timestamp"]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    proc = cli("night", "overnight", f"data.train={data}", "data.labels=null", *args, "--output", str(tmp_path / "l"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "l" / "lineage.json").exists()


def test_lineage_passes_sets_a_nights_length_by_its_training_items(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:12]))
    line = night(tmp_path / "lineage", data, "data.format=preference", "objective=dpo", "lineage.passes=2")
    record = lineage.read_state(tmp_path / "lineage")["nights"][0]
    # 9 items trained (3 held out), batch 4: ceil(2 x 9 / 4)
    assert line.startswith("night 1: 12 new items, trained on 9") and record["steps"] == 5


def test_a_bad_line_is_named_or_left_out_as_data_on_bad_line_says(tmp_path):
    rows = [json.dumps(row) for row in timed_chats(4)]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join([rows[0], "{not json", *rows[1:]]) + "\n")
    with pytest.raises(BadInput, match=r"chats\.jsonl: line 2: not valid JSON .*data\.on_bad_line=skip"):
        read_records(data_section(data, "chat"))
    kept = read_records(SimpleNamespace(**{**vars(data_section(data, "chat")), "on_bad_line": "skip"}))
    assert [r.row["id"] for r in kept.items] == [json.loads(row)["id"] for row in rows] and kept.timed


@pytest.mark.parametrize("name", ["overnight", "overnight-smollm2", "overnight-prefs"])
def test_every_shipped_overnight_recipe_runs_as_a_nightly_lineage(tmp_path, name):
    """The shipped recipes as a user runs them every night, on their own backends (npu-sim for the smollm2 ones):
    only the base is swapped for the tiny one, for one step."""
    tiny = ("model.name=tiny-qwen2", "train.max_steps=1", "train.check_initial_loss=false")
    proc = cli("night", name, *tiny, "--output", str(tmp_path / "lineage"))
    assert proc.returncode == 0, proc.stderr
    state = lineage.read_state(tmp_path / "lineage")
    assert len(state["nights"]) == 1 and state["nights"][0]["steps"] >= 1
