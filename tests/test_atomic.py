"""Atomic writes: a failure at any point leaves the old target as it was and no temp paths behind."""

import os

import pytest

from lcsb_cli import atomic


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "weights").write_text("old")
    real_rename = os.rename

    def failing_rename(src, dst):
        # the new dir's rename fails
        if str(dst) == str(target) and not str(src).endswith(".old"):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", failing_rename)
    with pytest.raises(OSError):
        atomic.write_dir(target, lambda tmp: (tmp / "weights").write_text("new"), replace=True)
    assert (target / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_a_failed_write_leaves_nothing(tmp_path):
    def broken_dir(tmp):
        (tmp / "part").write_text("half")
        raise KeyboardInterrupt

    def broken_file(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.write_dir(tmp_path / "new", broken_dir)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_file(tmp_path / "new.gguf", broken_file)
    assert list(tmp_path.iterdir()) == []


def test_replace_swaps_a_whole_directory(tmp_path):
    target = tmp_path / "step-2"
    atomic.write_dir(target, lambda tmp: (tmp / "a").write_text("1"))
    assert atomic.write_dir(target, lambda tmp: (tmp / "b").write_text("2"), replace=True)
    assert sorted(p.name for p in target.iterdir()) == ["b"] and [p.name for p in tmp_path.iterdir()] == ["step-2"]
    # taken: kept as it is
    assert not atomic.write_dir(target, lambda tmp: (tmp / "c").write_text("3"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]
