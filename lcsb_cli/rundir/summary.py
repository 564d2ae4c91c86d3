"""Step statistics: summary.json's totals of a run, the totals over per-user runs, and bench's per-method figures."""

from __future__ import annotations

import statistics
from collections import Counter

BASE = ("final_loss", "median_step_time_s", "tokens_per_s", "peak_mem_mb")


def step_stats(steps: list[dict]) -> dict:
    """Figures of a list of step rows: medians of the per-step times, tokens/s as all tokens over all step time
    (not a mean of per-step rates, which short steps would inflate), the peak, the last loss; the forward and
    backward medians and the simulated phone's figures where every row carries them."""
    if not steps:
        return dict.fromkeys(BASE)
    stats = {
        "final_loss": steps[-1]["loss"],
        "median_step_time_s": _median(steps, "step_time_s"),
        "tokens_per_s": sum(r["tokens"] for r in steps) / sum(r["step_time_s"] for r in steps),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in steps),
    }
    if _all_carry(steps, "forward_s", "backward_s"):
        stats.update(median_forward_s=_median(steps, "forward_s"), median_backward_s=_median(steps, "backward_s"))
    if _all_carry(steps, "sim_step_time_s", "sim_energy_j", "sim_temp_c", "npu_util"):
        stats.update(
            sim_median_step_time_s=_median(steps, "sim_step_time_s"),
            sim_median_energy_j=_median(steps, "sim_energy_j"),
            sim_energy_j=sum(r["sim_energy_j"] for r in steps),
            sim_max_temp_c=max(r["sim_temp_c"] for r in steps),
            npu_util=_median(steps, "npu_util"),
        )
    # the lanes' busy times
    if _all_carry(steps, "sim_npu_s", "sim_cpu_s"):
        stats.update(sim_median_npu_s=_median(steps, "sim_npu_s"), sim_median_cpu_s=_median(steps, "sim_cpu_s"))
    # the same steps priced for the other trainers
    if _all_carry(steps, "sim_cpu_trainer_s", "sim_gpu_trainer_s"):
        stats.update(
            sim_median_cpu_trainer_s=_median(steps, "sim_cpu_trainer_s"),
            sim_median_gpu_trainer_s=_median(steps, "sim_gpu_trainer_s"),
        )
    return stats


def summarize(rows: list[dict], method, wall_time_s: float) -> dict:
    steps = [r for r in rows if "loss" in r]
    return {
        "method": method.name,
        "blocks": method.blocks,
        "steps": steps[-1]["step"] if steps else 0,
        **step_stats(steps),
        "wall_time_s": wall_time_s,
        "diverged": False,
        "events": dict(Counter(r["event"] for r in rows if "event" in r)),
    }


def aggregate(summaries: list[dict]) -> dict:
    """Per-user summaries combined: each user's step statistics come from step_stats; this only pools them. Users
    that early stopping ended are counted (`early_stopped_users`); each one's best step is in its own summary.json."""
    first = summaries[0]
    early = sum(1 for s in summaries if s.get("early_stopped"))
    return {
        "method": first["method"],
        "blocks": first["blocks"],
        "steps": sum(s["steps"] for s in summaries),
        "final_loss": statistics.mean(s["final_loss"] for s in summaries),
        "median_step_time_s": statistics.median(s["median_step_time_s"] for s in summaries),
        "tokens_per_s": statistics.mean(s["tokens_per_s"] for s in summaries),
        "peak_mem_mb": max(s["peak_mem_mb"] for s in summaries),
        "wall_time_s": sum(s["wall_time_s"] for s in summaries),
        "diverged": any(s["diverged"] for s in summaries),
        "events": dict(sum((Counter(s["events"]) for s in summaries), Counter())),
        "memory": max(
            (s["memory"] for s in summaries if s.get("memory")), key=lambda m: m["peak_rss_mb"], default=None
        ),
        **({"early_stopped_users": early} if early else {}),
    }


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in steps)


def _all_carry(steps: list[dict], *keys: str) -> bool:
    return all(key in r for r in steps for key in keys)
