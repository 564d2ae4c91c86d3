"""Shared helpers for tests that train real (tiny) models."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from lcsb_cli.data import build_train_batches
from lcsb_cli.model.load import load_model
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.entry import train
from lcsb_cli.rundir import read_metrics

REPO = Path(__file__).resolve().parent.parent
# the shipped LaMP-2 recipe on the tiny random-init preset
LAMP2 = REPO / "tests" / "tiny.yaml"


def without_cache_caps() -> dict:
    """This environment without the kernel-cache sizes a model load in this process set (`limit_kernel_caches`), so a
    child process's recipe decides its own."""
    return {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}


NOISY_MAIN = (
    "from lcsb_cli.runtime import install; install(); import noisy_library; noisy_library.install(); "
    "from lcsb_cli.cli import app; app(prog_name='lcsb')"
)


def lcsb(*args: str, cwd: Path = REPO, timeout: float = 120, noisy: bool = False) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a `python -m lcsb_cli` subprocess, offline, on the tests' model cache. `noisy`:
    with tests/noisy_library.py's stand-in library imported after lcsb, as its dependencies are."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "PYTHONWARNINGS", "CLICOLOR_FORCE")}
    env["HF_HUB_OFFLINE"] = "1"
    env["LCSB_CACHE"] = os.environ["LCSB_CACHE"]
    if noisy:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    main = ["-c", NOISY_MAIN] if noisy else ["-m", "lcsb_cli"]
    return subprocess.run(
        [sys.executable, *main, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def cli(*args: str, cwd: Path = REPO, setup=None) -> subprocess.CompletedProcess:
    """The CLI in this process, as `python -m lcsb_cli` calls it (`app(...)`, exit code from SystemExit), with stdout
    and stderr captured: what `lcsb()` returns without a fresh interpreter's ~10 s of imports. Libraries' import-time
    output happens once per test process here, so a few cases also run through `lcsb()` (test_bad_input). `setup`
    runs inside the capture, before the command."""
    import transformers  # noqa: F401 - its log handler binds the real stderr before any capture starts
    from click.testing import CliRunner

    from lcsb_cli.cli import app

    home = os.getcwd()
    os.chdir(cwd)
    try:
        with CliRunner().isolation() as (out, err, _):
            try:
                # inside the capture, as a library imported by this command would be
                if setup is not None:
                    setup()
                app(args=list(args), prog_name="lcsb")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        os.chdir(home)
    return subprocess.CompletedProcess(["lcsb", *args], code, stdout, stderr)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Bad input as the CLI answers it: exit 2, no traceback, and stderr one `error:` line naming every needle (in
    any case). Returns that line."""
    everything = proc.stdout + proc.stderr
    assert "Traceback" not in everything, everything
    assert proc.returncode == 2, everything
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    missing = [n for n in needles if n.lower() not in lines[0].lower()]
    assert not missing, f"{missing} not in {lines[0]!r}"
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (dirs too, so an added empty or temp dir shows) with the sha256 of each file."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


class Quiet:
    def on_start(self, info):
        pass

    def on_step(self, row):
        pass

    def on_end(self, summary):
        pass


def run_train(run_dir: Path, *overrides: str, resume: bool = False, force: bool = False, recipe: Path = LAMP2) -> dict:
    recipe = load_recipe(recipe, ["train.log_every=1", *overrides])
    return train(recipe, run_dir, Quiet(), resume=resume, force=force)


def adapter_tensors(run_dir: Path) -> dict:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def model_and_first_batch(*overrides: str, for_gradients: bool = False):
    """The tiny LaMP-2 recipe's model (with `overrides`) on the CPU, and its first training batch. `for_gradients`:
    LoRA B (zero at the start) gets seeded values, so every LoRA tensor gets a gradient, and the model trains."""
    recipe = load_recipe(LAMP2, list(overrides))
    loaded = load_model(recipe, torch.device("cpu"))
    batch = build_train_batches(recipe, loaded.tokenizer).batch(0)
    if for_gradients:
        with torch.no_grad():
            for name, p in loaded.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        loaded.model.train()
    return loaded, batch


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def kill_after_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL `proc`, an `lcsb train` into `run_dir`, once its metrics.jsonl has logged `step`; it must still be
    running then (no adapter written yet)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        rows = read_metrics(metrics) if metrics.is_file() else []
        if rows and rows[-1]["step"] >= step:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert not (run_dir / "adapter").exists()
