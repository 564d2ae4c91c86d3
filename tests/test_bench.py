"""`lcsb bench`: every method in one bench.json with the contract's fields, and the plot renders."""

import json
import os
import subprocess
import sys

from helpers import LAMP2, REPO

FIELDS = {"name", "median_step_time_s", "tokens_per_s", "peak_mem_mb", "final_loss", "eval", "diverged", "speedup"}


def test_bench_runs_methods_interleaved_and_writes_its_reports(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "lcsb_cli", "bench", str(LAMP2), "--compare", "full-backprop", "--compare", "mezo",
           "--compare", "hf-trainer", "--compare", "lcsb:2", "--steps", "2", "--warmup", "1", "--eval",
           "--output", str(out), "lcsb.blocks=4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["baseline"] == "full-backprop"
    assert [m["name"] for m in result["methods"]] == ["lcsb:4", "full-backprop", "mezo", "hf-trainer", "lcsb:2"]
    for method in result["methods"]:
        assert FIELDS <= set(method)
        assert method["eval"]["n"] == 90 and 0 <= method["eval"]["accuracy"] <= 1
    base = next(m for m in result["methods"] if m["name"] == "full-backprop")
    assert base["speedup"] == 1.0
    lcsb = result["methods"][0]
    assert lcsb["ceiling"] == (result["forward_s"] + result["backward_s"]) / (
        result["forward_s"] + result["backward_s"] / 4)
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "| lcsb:4 |" in (out / "bench.md").read_text()
    memory = {m["name"]: m["memory"] for m in result["methods"]}
    assert memory["hf-trainer"] is None  # HF's own loop: the engine's probes see none of it
    assert 0 < memory["lcsb:4"]["activations_mb"] < memory["full-backprop"]["activations_mb"] / 2
    assert "Peak RSS breakdown" in (out / "bench.md").read_text()


def test_bench_refuses_an_unknown_method_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lcsb_cli", "bench", str(LAMP2), "--compare", "sgd",
                           "--output", str(tmp_path / "b")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown method 'sgd'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()


def test_bench_on_npu_sim_reports_the_simulated_phone_per_method():
    from lcsb_cli.bench.compare import bench_markdown, summarize_bench

    from lcsb_cli.recipe import load_recipe

    def rows(sim_s, energy):
        return [{"step_time_s": 1.0, "tokens": 10, "peak_mem_mb": 1.0, "loss": 1.0, "sim_step_time_s": s,
                 "sim_energy_j": energy, "npu_util": 0.5} for s in sim_s]

    timed = {"lcsb:4": rows([0.02, 0.03, 0.025], 0.1), "full-backprop": rows([0.05, 0.06, 0.05], 0.3)}
    result = summarize_bench(["lcsb:4", "full-backprop"], timed, timed, {})
    lcsb, full = result["methods"]
    assert full["sim_speedup"] == 1.0 and lcsb["sim_speedup"] == 0.05 / 0.025
    assert lcsb["sim_energy_j"] == 0.1 and lcsb["npu_util"] == 0.5
    text = bench_markdown(result, load_recipe(LAMP2, ["backend=npu-sim"]), 3, 0)
    assert "Simulated on-device (npu-sim, snapdragon-8gen3, int8 weights)" in text and "| lcsb:4 | 25.00 |" in text
