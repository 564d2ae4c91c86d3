"""The wheel a user installs carries everything the checkout has: recipes, sample data, presets, the lamp-tiny
checkpoint and tokenizer (package data, read through importlib.resources)."""

import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

# builds and installs a wheel
pytestmark = pytest.mark.slow


def test_a_wheel_installed_elsewhere_lists_validates_and_trains_the_shipped_recipes(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("lcsb-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "HF_HUB_OFFLINE": "1"}

    def lcsb(*args):
        return subprocess.run(
            [sys.executable, "-m", "lcsb_cli", *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    where = subprocess.run(
        [sys.executable, "-c", "import lcsb_cli; print(lcsb_cli.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    # the wheel's copy, not the checkout
    assert where.stdout.startswith(str(tmp_path / "site")), where
    listed = lcsb("recipes")
    assert listed.returncode == 0 and "lamp2 " in listed.stdout and "overnight " in listed.stdout, listed
    validated = lcsb("validate", "lamp2")
    assert validated.returncode == 0 and "name: lamp2" in validated.stdout, validated.stderr
    trained = lcsb("train", "lamp2", "data.user=null", "overnight.report=false", "train.max_steps=2", "-o", "run")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (elsewhere / "run" / "adapter" / "adapter_model.safetensors").is_file()
