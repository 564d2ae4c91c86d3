"""summary.json: a run's totals from its metrics rows, and the totals over per-user runs."""

from __future__ import annotations

import statistics
from collections import Counter


def aggregate(summaries: list[dict]) -> dict:
    first = summaries[0]
    return {
        "method": first["method"], "blocks": first["blocks"], "steps": sum(s["steps"] for s in summaries),
        "final_loss": statistics.mean(s["final_loss"] for s in summaries),
        "median_step_time_s": statistics.median(s["median_step_time_s"] for s in summaries),
        "tokens_per_s": statistics.mean(s["tokens_per_s"] for s in summaries),
        "peak_mem_mb": max(s["peak_mem_mb"] for s in summaries),
        "wall_time_s": sum(s["wall_time_s"] for s in summaries),
        "diverged": any(s["diverged"] for s in summaries),
        "events": dict(sum((Counter(s["events"]) for s in summaries), Counter())),
        "memory": max((s["memory"] for s in summaries if s.get("memory")), key=lambda m: m["peak_rss_mb"],
                      default=None),
    }


def summarize(rows: list[dict], method, wall_time_s: float) -> dict:
    steps = [r for r in rows if "loss" in r]
    times = [r["step_time_s"] for r in steps]
    tokens = sum(r["tokens"] for r in steps)
    return {
        "method": method.name, "blocks": method.blocks, "steps": steps[-1]["step"] if steps else 0,
        "final_loss": steps[-1]["loss"] if steps else None,
        "median_step_time_s": statistics.median(times) if times else None,
        "tokens_per_s": tokens / sum(times) if times else None,
        "peak_mem_mb": max((r["peak_mem_mb"] for r in steps), default=None),
        "wall_time_s": wall_time_s, "diverged": False,
        "events": dict(Counter(r["event"] for r in rows if "event" in r)),
        **_simulated_totals(steps),
    }


def _simulated_totals(steps: list[dict]) -> dict:
    """npu-sim runs: the simulated phone's totals."""
    if not steps or "sim_step_time_s" not in steps[-1]:
        return {}
    return {"sim_median_step_time_s": statistics.median(r["sim_step_time_s"] for r in steps),
            "sim_energy_j": sum(r["sim_energy_j"] for r in steps), "sim_max_temp_c": max(r["sim_temp_c"] for r in steps),
            "npu_util": statistics.median(r["npu_util"] for r in steps)}
