"""The sample writers (tools/build/): deterministic, and what they write now is what the repository holds."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic import corpus_lines, write_lamp2_sample

from lcsb_cli.data.lamp2 import TAGS

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "tools" / "build"
SAMPLE = REPO / "recipes" / "data" / "lamp2"
SAMPLE_FILES = ("train_questions.json", "train_outputs.json", "dev_questions.json", "dev_outputs.json")
PERSONAL = REPO / "recipes" / "data" / "personal"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_personal_sample", BUILD / "make_personal_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lamp2_generator_is_deterministic_and_matches_committed(tmp_path):
    write_lamp2_sample(tmp_path / "a", seed=0)
    script = BUILD / "make_lamp2_sample.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "b"), "--seed", "0"], check=True, capture_output=True
    )
    for name in SAMPLE_FILES:
        committed = (SAMPLE / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() == committed
        assert (tmp_path / "b" / name).read_bytes() == committed
    write_lamp2_sample(tmp_path / "c", seed=1)
    assert (tmp_path / "c" / "train_outputs.json").read_bytes() != (SAMPLE / "train_outputs.json").read_bytes()


def test_corpus_lines_are_deterministic():
    lines = corpus_lines(0)
    assert lines == corpus_lines(0)
    assert set(TAGS) <= set(lines)
    assert any(line.startswith('the tag for the movie: "') and line.endswith('" is "sci-fi"') for line in lines)
    assert any(line.startswith("Which tag does this movie relate to") for line in lines)


def test_personal_generator_is_deterministic(tmp_path, generator):
    first = generator.write_sample(tmp_path / "a", seed=3).read_bytes()
    second = generator.write_sample(tmp_path / "b", seed=3).read_bytes()
    assert first == second
    assert generator.write_sample(tmp_path / "c", seed=4).read_bytes() != first


def test_shipped_personal_sample_matches_default_generation(tmp_path, generator):
    generator.main(["--out", str(tmp_path)])
    assert (tmp_path / "messages.jsonl").read_bytes() == (PERSONAL / "messages.jsonl").read_bytes()
    assert (tmp_path / "movies.jsonl").read_bytes() == (PERSONAL / "movies.jsonl").read_bytes()


def test_preference_generator_writes_the_committed_sample(tmp_path):
    script = BUILD / "make_preference_sample.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
    committed = REPO / "recipes" / "data" / "prefs"
    names = sorted(p.name for p in committed.glob("*.jsonl"))
    assert names == sorted(p.name for p in tmp_path.glob("*.jsonl")) and len(names) == 4
    for name in names:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
