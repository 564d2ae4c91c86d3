"""The measurement tools (tools/measure/): the roofline guard's rows, step_times under its knobs, a projected night."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lcsb_cli.backends.npu_sim.device import load_profile

REPO = Path(__file__).resolve().parents[2]
MEASURE = REPO / "tools" / "measure"
TINY = REPO / "tests" / "tiny.yaml"
PROFILE = load_profile("snapdragon-8gen3")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, MEASURE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_roofline_guard_records_each_share_with_the_host_kind(tmp_path):
    roofline_guard = load("roofline_guard")
    result = {
        "matmul_probe": {"host": "native bf16: amx_bf16", "threads": 2},
        "matmul_limit_gflops": {"float32": 100.0, "bfloat16": 400.0},
        "methods": [
            {
                "name": "lcsb:4",
                "compute_dtype": "bfloat16",
                "achieved_gflops": 280.0,
                "roofline_fraction": 0.7,
                "speedup": 1.7,
            },
            {"name": "mezo", "compute_dtype": "float32", "speedup": 0.5},
        ],
    }
    rows = roofline_guard.rows(result, "bench-smollm2")
    assert len(rows) == 1 and rows[0].endswith(
        "| native bf16: amx_bf16, 2 threads | bench-smollm2 | lcsb:4 | bf16 | 400.0 | 280.0 | 70% | 1.70x |"
    )
    results = tmp_path / "RESULTS.md"
    results.write_text(f"| head |\n{roofline_guard.MARKER}\nafter\n")
    roofline_guard.record(results, rows)
    assert results.read_text().splitlines()[1:] == [rows[0], roofline_guard.MARKER, "after"]
    results.with_name("other.md").write_text("| head |\n")
    with pytest.raises(SystemExit, match="no <!-- roofline-guard --> line"):
        roofline_guard.record(results.with_name("other.md"), rows)


def test_step_times_times_the_engines_steps_under_the_math_attention_beside_a_busy_core():
    cmd = [sys.executable, str(MEASURE / "step_times.py"), str(TINY), "train.batch_size=2", "--steps", "3"]
    done = subprocess.run(
        [*cmd, "--warmup", "1", "--sdpa", "math", "--busy"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("train.batch_size=2 sdpa=math busy: steps ")
    assert len(line.split("steps ")[1].split(" s;")[0].split()) == 3


@pytest.mark.slow
def test_a_projected_night_throttles_when_the_closed_form_says_and_then_pauses_at_max_temp():
    script = load("thermal_night")
    # a SmolLM2 step's shape
    step = {"sim_step_time_s": 0.2, "sim_npu_s": 0.04, "sim_cpu_s": 0.2}
    power = script.step_cost(step, PROFILE, throttled=False)[1] / 0.2
    assert script.step_cost(step, PROFILE, throttled=True)[0] == pytest.approx(
        0.2 + 0.04 / PROFILE.throttle_clock - 0.04
    )
    night = script.night([step], PROFILE, max_temp_c=42.0, hours=1.0)
    rise = power * PROFILE.skin_to_ambient_c_per_w
    tau_skin = PROFILE.skin_heat_capacity_j_per_c * PROFILE.skin_to_ambient_c_per_w
    one_mass = -tau_skin * math.log(1 - (PROFILE.throttle_c - PROFILE.ambient_c) / rise)
    assert night["first_throttle"]["minute"] * 60 == pytest.approx(one_mass, rel=0.05)
    assert night["cool_down_pauses"] >= 1 and 0.3 < night["training_share"] < 1
    # the job never lets the skin run past max_temp_c
    assert night["final_skin_c"] <= 42.0 + 0.1
    # pauses end at 40 C, above the clock's 37 C: half clock for the rest
    assert night["clock_restores"] == 0


def test_call_path_finds_the_loop_on_the_stack_at_the_first_optimizer_step():
    proc = subprocess.run(
        [sys.executable, str(MEASURE / "call_path.py")], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["stack"][-1] == "run/trainer.py:Trainer._backprop_update"
    assert "run/entry.py:train" in found["stack"] and found["stack_files"] == len(
        {s.split(":")[0] for s in found["stack"]}
    )
    assert found["setup_functions"] > found["stack_functions"]


def test_user_memory_gives_each_users_peak_and_the_runs():
    proc = subprocess.run(
        [sys.executable, str(MEASURE / "user_memory.py"), "2", "train.max_steps=1", "overnight.report=false"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    # each user's, then the run's own end
    assert len(found["peaks"]) == len(found["ends"]) == 3
    assert found["run_peak"] >= max(found["peaks"][:2]) > 0
    # the RSS each user starts from, after the ones before it were freed: below the peak of the user before
    assert len(found["left"]) == 2 and found["left"][1] < found["peaks"][0]


def test_user_memory_clones_train_the_same_user_under_new_ids():
    sample = load("user_memory").sample(3, clones=True)
    questions = sample["dev_questions.json"]
    assert sorted({q["user_id"] for q in questions}) == ["clone_000", "clone_001", "clone_002"]
    by_user = [[(q["input"], q["profile"]) for q in questions if q["user_id"] == u] for u in ("clone_000", "clone_002")]
    assert by_user[0] == by_user[1] and len(by_user[0]) > 0
    golds = {g["id"]: g["output"] for g in sample["dev_outputs.json"]["golds"]}
    assert [golds[q["id"]] for q in questions if q["user_id"] == "clone_000"] == [
        golds[q["id"]] for q in questions if q["user_id"] == "clone_001"
    ]
