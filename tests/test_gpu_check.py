"""scripts/gpu_check.sh: the GPU check's dry run (every step on the cpu backend, end to end) and its wheel thinning."""

import importlib.util
import json
import os
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

STEPS = ["environment", "methods", "k1_full", "resume_kill9", "gguf_packed", "nf4", "bench", "cuda_test"]


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu_and_writes_one_report(tmp_path):
    # no carried wheels: this venv has lcsb's pins
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none")}
    command = ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {name: str(step.get("error", step))[:500] for name, step in report["steps"].items() if not step.get("ok")}
    assert proc.returncode == 0 and report["ok"], failed
    assert list(report["steps"]) == STEPS and report["backend"] == "cpu" and report["dry_run"]
    steps = report["steps"]
    assert sorted(steps["methods"]["runs"]) == sorted(
        f"{variant}-{precision}" for variant in gpu_check.VARIANTS for precision in gpu_check.PRECISIONS
    )
    assert all(len(run["device"]["losses"]) == gpu_check.COMPARED_STEPS for run in steps["methods"]["runs"].values())
    assert steps["k1_full"]["fp32"]["ok"] and steps["k1_full"]["bf16"]["ok"]
    assert steps["resume_kill9"]["adapter_identical"] and steps["resume_kill9"]["losses_equal"]
    # tiny-qwen2: 4 layers of 7 projections, their blocks where the run trains
    assert steps["gguf_packed"]["packed_layers"] == 28 and steps["gguf_packed"]["blocks_on"] == ["cpu"]
    assert "skipped" not in steps["nf4"]
    bench = steps["bench"]["methods"]
    assert (
        sorted(bench) == ["full-backprop", "lcsb:4:identity", "lcsb:4:suffix"]
        and bench["full-backprop"]["speedup"] == 1
    )
    assert all(m["median_step_time_s"] > 0 and m["peak_mem_mb"] > 0 for m in bench.values())
    # the suite's cuda test skips itself on a CPU
    assert "1 skipped" in steps["cuda_test"]["pytest"]


def test_bitsandbytes_travels_with_the_cuda_13_and_cpu_libraries_only(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    libs = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm72", "xpu2026"]
    names = ["bitsandbytes/__init__.py", *(f"bitsandbytes/libbitsandbytes_{lib}.so" for lib in libs)]
    record = "bitsandbytes-0.50.2.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in names:
            zf.writestr(name, b"x" * 100)
        zf.writestr(record, "".join(f"{name},sha256=x,100\n" for name in names) + f"{record},,\n")
    gpu_check.thin_bitsandbytes(wheel)
    kept = ["bitsandbytes/__init__.py", *(f"bitsandbytes/libbitsandbytes_{lib}.so" for lib in libs[:1] + libs[3:5])]
    with zipfile.ZipFile(wheel) as zf:
        assert zf.namelist() == [*kept, record]
        assert [line.split(",")[0] for line in zf.read(record).decode().splitlines()] == [*kept, record]
