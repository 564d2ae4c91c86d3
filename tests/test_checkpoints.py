"""Checkpoints: a corrupt newest one is skipped on resume (and the run still ends bit-identical), a crash while
writing one leaves the previous intact, a pickle that would run code is refused, retention and the manifest."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, assert_one_line_error, assert_same_tensors, cli, run_train, snapshot

from lcsb_cli.errors import BadInput
from lcsb_cli.rundir import read_metrics
from lcsb_cli.rundir.checkpoint import (
    ADAPTER_FILE,
    MANIFEST,
    STATE_FILE,
    CorruptCheckpoint,
    checkpoint_dirs,
    load_checkpoint,
    save_checkpoint,
)

R = str(LAMP2.relative_to(REPO))


def names(run: Path) -> list[str]:
    """Every entry of checkpoints/ (temp dirs included), oldest step first."""
    return sorted((p.name for p in (run / "checkpoints").iterdir()), key=lambda n: (n.startswith("."), len(n), n))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def small(step: int) -> tuple[dict, dict]:
    adapter = {"lora_A": torch.arange(6.0).reshape(2, 3) + step, "lora_B": torch.full((4,), float(step))}
    state = {
        "step": step,
        "wall_time_s": 0.5 * step,
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3) * step}}},
        "rng": {"torch": torch.get_rng_state(), "cuda": []},
    }
    return adapter, state


def assert_state_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_state_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A max_steps=6 run (checkpoints step-2/4/6) and the uninterrupted max_steps=8 run to compare against."""
    root = tmp_path_factory.mktemp("checkpoints")
    run_train(root / "six", "train.max_steps=6", "train.save_every=2")
    run_train(root / "eight", "train.max_steps=8", "train.save_every=2")
    # KEEP_CHECKPOINTS = 3
    assert names(root / "six") == ["step-2", "step-4", "step-6"]
    return root


# --- a corrupt newest checkpoint -----------------------------------------------------------------


@pytest.mark.parametrize("victim", [STATE_FILE, ADAPTER_FILE, MANIFEST])
def test_resume_skips_a_corrupt_newest_checkpoint_and_loses_no_step(runs, tmp_path, victim):
    run = tmp_path / "run"
    shutil.copytree(runs / "six", run)
    path = run / "checkpoints" / "step-6" / victim
    data = path.read_bytes()
    # a torn write
    path.write_bytes(data[: len(data) // 2])

    proc = cli("train", R, "--output", str(run), "--resume", "train.max_steps=8", "train.save_every=2")

    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, said
    assert "Traceback" not in said
    assert "skipped checkpoint step-6" in said and "resuming from step-4" in said, said
    rows = read_metrics(run / "metrics.jsonl")
    events = [r for r in rows if r.get("event") == "checkpoint_corrupt"]
    assert len(events) == 1, events
    assert events[0]["step"] == 6 and events[0]["resumed_from"] == 4 and victim in events[0]["reason"]
    steps = [r for r in rows if "loss" in r]
    # 1-4 kept, 5-8 logged once after the resume
    assert [r["step"] for r in steps] == list(range(1, 9))
    reference = [r for r in read_metrics(runs / "eight" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in steps] == [r["loss"] for r in reference]
    assert [r["active_block"] for r in steps] == [r["active_block"] for r in reference]
    assert_same_tensors(adapter_tensors(run), adapter_tensors(runs / "eight"))
    # the corrupt step-6 was rewritten, intact
    assert names(run) == ["step-4", "step-6", "step-8"]
    load_checkpoint(run / "checkpoints" / "step-6")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["events"].get("checkpoint_corrupt") == 1


@pytest.mark.parametrize("victim", [STATE_FILE, ADAPTER_FILE])
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_load_checkpoint_checks_every_file_against_the_manifest(tmp_path, victim, damage):
    final = save_checkpoint(tmp_path / "checkpoints", 3, *small(3), keep=3)
    path = final / victim
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(CorruptCheckpoint, match=victim):
        load_checkpoint(final)


def test_resume_with_every_checkpoint_corrupt_exits_2_and_changes_nothing(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "six", run)
    for step in (2, 4, 6):
        path = run / "checkpoints" / f"step-{step}" / STATE_FILE
        path.write_bytes(path.read_bytes()[:100])
    before = snapshot(run)

    proc = cli("train", R, "--output", str(run), "--resume", "train.max_steps=8", "train.save_every=2")

    assert "no intact checkpoint" in assert_one_line_error(proc)
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"step": 3}',
        '{"step": 3, "files": "state.pt"}',
        '{"step": 3, "files": null}',
        '{"step": 3, "files": 5}',
    ],
)
def test_a_damaged_manifest_is_a_corrupt_checkpoint(tmp_path, text):
    final = save_checkpoint(tmp_path / "checkpoints", 3, *small(3), keep=3)
    (final / MANIFEST).write_text(text)
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(final)


@pytest.mark.parametrize("stray", ["step-6.bak", "step-6-backup", "step-latest"])
def test_checkpoint_dirs_ignores_dirs_not_named_step_n(tmp_path, stray):
    final = save_checkpoint(tmp_path / "checkpoints", 4, *small(4), keep=3)
    # a user's backup copy, manifest and all
    shutil.copytree(final, tmp_path / "checkpoints" / stray)
    assert checkpoint_dirs(tmp_path / "checkpoints") == [final]
    # retention leaves what it did not write alone
    save_checkpoint(tmp_path / "checkpoints", 5, *small(5), keep=1)
    assert (tmp_path / "checkpoints" / stray / MANIFEST).is_file()


# --- a crash while writing ------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["enospc", "sigint"])
@pytest.mark.parametrize("next_step", [2, 1], ids=["new-step", "same-step"])
def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch, exc, next_step):
    run = tmp_path / "run"
    adapter, state = small(1)
    save_checkpoint(run / "checkpoints", 1, adapter, state, keep=3)
    before = snapshot(run)
    real_save = torch.save
    calls = []

    def crashing_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        # part of the file, then the crash
        Path(f).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        calls.append(Path(f))
        raise exc

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(type(exc)):
        save_checkpoint(run / "checkpoints", next_step, *small(next_step), keep=3)
    monkeypatch.undo()

    # it crashed inside the temp dir
    assert calls and calls[0].parent.name.startswith(f".step-{next_step}-")
    # no .tmp-* left behind, no half step-2
    assert names(run) == ["step-1"]
    assert snapshot(run) == before
    assert checkpoint_dirs(run / "checkpoints") == [run / "checkpoints" / "step-1"]
    loaded_adapter, loaded_state = load_checkpoint(run / "checkpoints" / "step-1")
    assert_same_tensors(loaded_adapter, adapter)
    assert_state_equal(loaded_state, state)


# --- pickles that would run code ------------------------------------------------------------------


class Payload:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _evil_bytes(kind: str, marker: Path) -> bytes:
    if kind == "torch.save":
        buffer = io.BytesIO()
        torch.save({"step": 2, "wall_time_s": 1.0, "optimizer": Payload(marker)}, buffer)
        return buffer.getvalue()
    return pickle.dumps({"step": 2, "optimizer": Payload(marker)}, protocol=2)


def _plant(checkpoint_dir: Path, data: bytes) -> None:
    """Replace state.pt and make the manifest's checksum match, as an attacker (or a careless tool) would."""
    (checkpoint_dir / STATE_FILE).write_bytes(data)
    manifest = json.loads((checkpoint_dir / MANIFEST).read_text())
    manifest["files"][STATE_FILE] = sha256(checkpoint_dir / STATE_FILE)
    (checkpoint_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["torch.save", "raw-pickle"])
def test_a_state_file_that_would_run_code_is_refused(tmp_path, kind):
    # the payload is live: a plain unpickle runs it
    control = tmp_path / "control-marker"
    raw = _evil_bytes(kind, control)
    if kind == "torch.save":
        torch.load(io.BytesIO(raw), weights_only=False)
    else:
        pickle.loads(raw)
    assert control.read_text() == "pwned"

    marker = tmp_path / "marker"
    final = save_checkpoint(tmp_path / "run" / "checkpoints", 2, *small(2), keep=3)
    _plant(final, _evil_bytes(kind, marker))
    with pytest.raises(BadInput, match="refused") as info:
        load_checkpoint(final)
    assert STATE_FILE in str(info.value)
    assert not marker.exists()


def test_cli_resume_refuses_a_run_whose_only_checkpoint_would_run_code(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "six", run)
    for step in ("step-2", "step-4"):
        shutil.rmtree(run / "checkpoints" / step)
    marker = tmp_path / "marker"
    _plant(run / "checkpoints" / "step-6", _evil_bytes("torch.save", marker))
    before = snapshot(run)

    proc = cli("train", R, "--output", str(run), "--resume", "train.max_steps=8", "train.save_every=2")

    line = assert_one_line_error(proc)
    assert "refused" in line and "step-6" in line and STATE_FILE in line
    assert not marker.exists()
    assert snapshot(run) == before


# --- retention and the manifest -------------------------------------------------------------------


def test_save_checkpoint_keeps_the_newest_and_lists_both_checksums(tmp_path):
    # across a digit boundary: "step-9" sorts after "step-12" as text
    for step in (8, 9, 10, 11, 12):
        save_checkpoint(tmp_path / "checkpoints", step, *small(step), keep=3)
    root = tmp_path / "checkpoints"
    assert checkpoint_dirs(tmp_path / "checkpoints") == [root / "step-12", root / "step-11", root / "step-10"]
    # nothing else: no temp dirs, no old steps
    assert names(tmp_path) == ["step-10", "step-11", "step-12"]
    for final in checkpoint_dirs(tmp_path / "checkpoints"):
        step = int(final.name.split("-")[1])
        assert sorted(p.name for p in final.iterdir()) == sorted([ADAPTER_FILE, STATE_FILE, MANIFEST])
        manifest = json.loads((final / MANIFEST).read_text())
        assert manifest["step"] == step
        assert manifest["files"] == {ADAPTER_FILE: sha256(final / ADAPTER_FILE), STATE_FILE: sha256(final / STATE_FILE)}
        adapter, state = load_checkpoint(final)
        expected_adapter, _expected_state = small(step)
        assert_same_tensors(adapter, expected_adapter)
        assert state["step"] == step and torch.equal(state["optimizer"]["state"][0]["exp_avg"], torch.ones(3) * step)

    save_checkpoint(tmp_path / "checkpoints", 13, *small(13), keep=1)
    assert names(tmp_path) == ["step-13"]
