"""A night on the simulated phone, projected from a finished npu-sim run: its measured steps (simulated time, NPU
and CPU busy time) repeated for HOURS of phone time through the profile's thermal model, with the overnight job's
cool-down pauses at overnight.max_temp_c. Prints when the NPU clock first throttled and what the night did.

Why a projection: the emulator runs a SmolLM2 step ~16x slower than the phone would, so a night's steps cannot be
emulated here. The steps' numerics are not re-run. Only the run's steps before its first throttle are replayed
(they ran at full clock); a throttled step's NPU time is that measured NPU time divided by the profile's
throttle_clock (all of it on the critical path: an upper bound).

    python tools/measure/thermal_night.py runs/overnight-smollm2 --hours 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lcsb_cli.backends.npu_sim import NpuSimBackend
from lcsb_cli.backends.npu_sim.device import load_profile
from lcsb_cli.backends.npu_sim.thermal import Thermal
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.job import COOL_MARGIN_C


def step_cost(step: dict, profile, throttled: bool) -> tuple[float, float]:
    """(seconds, joules) of one recorded step, re-priced for the NPU clock, as DeviceModel.end_step prices it."""
    npu = step["sim_npu_s"] / (profile.throttle_clock if throttled else 1.0)
    elapsed = step["sim_step_time_s"] + npu - step["sim_npu_s"]
    return elapsed, profile.npu_power_w * npu + profile.cpu_power_w * step["sim_cpu_s"] + profile.idle_power_w * elapsed


def night(steps: list[dict], profile, max_temp_c: float, hours: float) -> dict:
    thermal, clock, trained, done, pauses, first_throttle, restores = Thermal(profile), 0.0, 0.0, 0, 0, None, 0
    while clock < hours * 3600:
        if max_temp_c and thermal.skin_c > max_temp_c:
            pauses += 1
            while thermal.skin_c > max_temp_c - COOL_MARGIN_C and clock < hours * 3600:
                before = thermal.skin_c
                restores += "npu_clock_restored" in thermal.advance(NpuSimBackend.idle_poll_s, profile.idle_power_w)
                clock += NpuSimBackend.idle_poll_s
                # as cool as idle gets: the job trains on (Job.cool_down)
                if thermal.skin_c >= before - 1e-3:
                    break
            continue
        seconds, joules = step_cost(steps[done % len(steps)], profile, thermal.throttled)
        events = thermal.advance(seconds, joules / seconds)
        restores += "npu_clock_restored" in events
        if "npu_clock_throttled" in events and first_throttle is None:
            first_throttle = {
                "minute": (clock + seconds) / 60,
                "step": done + 1,
                "skin_c": thermal.skin_c,
                "soc_c": thermal.soc_c,
            }
        clock, trained, done = clock + seconds, trained + seconds, done + 1
    return {
        "hours": hours,
        "steps": done,
        "training_share": trained / clock,
        "first_throttle": first_throttle,
        "cool_down_pauses": pauses,
        "clock_restores": restores,
        "final_skin_c": thermal.skin_c,
        "final_soc_c": thermal.soc_c,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--hours", type=float, default=5.0)
    args = parser.parse_args()
    recipe = load_recipe(args.run_dir / "config.yaml")
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    first_throttle = min((r["step"] for r in rows if r.get("event") == "npu_clock_throttled"), default=float("inf"))
    # priced at full clock
    steps = [r for r in rows if "sim_step_time_s" in r and r["step"] <= first_throttle]
    profile = load_profile(recipe.npu_sim.device)
    mean_power = sum(step_cost(s, profile, False)[1] for s in steps) / sum(s["sim_step_time_s"] for s in steps)
    print(
        json.dumps(
            {
                "run": str(args.run_dir),
                "device": profile.name,
                "measured_steps": len(steps),
                "mean_step_s": sum(s["sim_step_time_s"] for s in steps) / len(steps),
                "mean_power_w": mean_power,
                **night(steps, profile, recipe.overnight.max_temp_c, args.hours),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
