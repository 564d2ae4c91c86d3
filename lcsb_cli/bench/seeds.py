"""bench over seeds: each method's mean, standard deviation and per-seed values, and loss curves with a band."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

PER_SEED = ("final_loss", "steps", "train_time_s", "median_step_time_s", "speedup", "diverged", "eval")


def combine_seeds(per_seed: list[dict], seeds: list[int]) -> dict:
    """One bench result from one per seed (same methods, same order): numbers become their mean over the seeds, with
    the sample standard deviation under `std` (0 for one seed); `seeds` keeps each seed's own values."""
    methods = []
    for entries in zip(*(result["methods"] for result in per_seed)):
        numeric = [
            key
            for key, value in entries[0].items()
            if _is_number(value) and all(_is_number(e.get(key)) for e in entries)
        ]
        evals = [e["eval"] for e in entries]
        combined = {
            **entries[0],
            **{key: statistics.fmean(e[key] for e in entries) for key in numeric},
            "diverged": any(e["diverged"] for e in entries),
            "eval": _mean_eval(evals),
            "std": {**{key: _std([e[key] for e in entries]) for key in numeric}, "eval": _std_eval(evals)},
            "seeds": [{"seed": seed, **{key: e.get(key) for key in PER_SEED}} for seed, e in zip(seeds, entries)],
        }
        methods.append(combined)
    return {"baseline": per_seed[0]["baseline"], "seeds": seeds, "methods": methods}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _eval_keys(evals: list[dict | None]) -> list[str]:
    if any(e is None for e in evals):
        return []
    return [key for key, value in evals[0].items() if _is_number(value) and all(_is_number(e.get(key)) for e in evals)]


def _mean_eval(evals: list[dict | None]) -> dict | None:
    if evals[0] is None:
        return None
    return {**evals[0], **{key: statistics.fmean(e[key] for e in evals) for key in _eval_keys(evals)}}


def _std_eval(evals: list[dict | None]) -> dict | None:
    return None if evals[0] is None else {key: _std([e[key] for e in evals]) for key in _eval_keys(evals)}


def plot_loss_curves(runs: list[dict[str, list[dict]]], path: Path) -> None:
    """Training loss against step and against training time: each method's mean over the seeds, with a band of one
    standard deviation (time: each seed's curve interpolated onto a grid up to the shortest seed's end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name in runs[0]:
        seeds = [run[name] for run in runs]
        steps = min(len(rows) for rows in seeds)
        losses = np.array([[r["loss"] for r in rows[:steps]] for rows in seeds])
        _band(by_step, np.arange(1, steps + 1), losses, name)
        clocks = [np.cumsum([r["step_time_s"] for r in rows]) for rows in seeds]
        grid = np.linspace(max(c[0] for c in clocks), min(c[-1] for c in clocks), 200)
        on_grid = np.array([np.interp(grid, c, [r["loss"] for r in rows]) for c, rows in zip(clocks, seeds)])
        _band(by_time, grid, on_grid, name)
    seeds_note = f" (mean of {len(runs)} seeds, band: ±1 std)" if len(runs) > 1 else ""
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step" + seeds_note)
    by_time.set(xlabel="training time (s)", ylabel="training loss", title="loss vs training time")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _band(axis, x: np.ndarray, values: np.ndarray, label: str) -> None:
    mean = values.mean(axis=0)
    (line,) = axis.plot(x, mean, label=label)
    if len(values) > 1:
        std = values.std(axis=0, ddof=1)
        axis.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
