"""`lcsb bench`: the recipe's method and each compared method on the same data, seeds and model, with
interleaved timed steps, one worker process per method, at equal steps or equal time."""

from __future__ import annotations

from pathlib import Path

from ..atomic import write_json_atomic, write_text_atomic
from ..errors import BadInput
from ..methods import LABEL_FORMS, blocks_of, label_of, recipe_for_label
from ..recipe import Recipe, replace_key, with_overrides
from ..rundir.summary import step_stats
from .roofline import compute_dtype, roofline_fields
from .seeds import combine_seeds, plot_loss_curves
from .session import (
    BASELINE,
    BUDGETS,
    HF_TRAINER_LABELS,
    hf_trainer_bf16,
    is_hf_trainer,
    run_session,
    split_variant,
)
from .table import bench_markdown


def method_names(recipe: Recipe, compare: list[str], budget: str = "equal-steps") -> list[str]:
    """The recipe's own method, then each compared one; equal-time adds full backprop, whose time is the budget."""
    if budget not in BUDGETS:
        raise BadInput(f"--budget: unknown budget {budget!r}; choose from {', '.join(BUDGETS)}")
    for name in compare:
        method, overrides = split_variant(name)
        if not is_hf_trainer(method) and recipe_for_label(method, recipe) is None:
            raise BadInput(
                f"--compare: unknown method {method!r}; choose from {', '.join((*LABEL_FORMS, *HF_TRAINER_LABELS))}, "
                "each optionally with @KEY=VALUE[,KEY=VALUE]"
            )
        with_overrides(recipe, overrides, f"--compare {name}")
    return list(dict.fromkeys([label_of(recipe), *compare, *([BASELINE] if budget == "equal-time" else [])]))


def method_recipe(recipe: Recipe, name: str, total_steps: int) -> Recipe:
    """The recipe as `name` runs it, its LR schedule spanning the bench's `total_steps`."""
    label, overrides = split_variant(name)
    recipe = with_overrides(recipe, overrides, f"--compare {label}") if overrides else recipe
    recipe = replace_key(recipe, "train.max_steps", total_steps)
    # the users' alternative in its own setup: fp32 weights, Trainer's precision
    if is_hf_trainer(label):
        plain = replace_key(replace_key(recipe, "activation_checkpointing", False), "model.dtype", "float32")
        return replace_key(plain, "train.autocast", "none")
    return recipe_for_label(label, recipe)


def run_bench(
    recipe: Recipe,
    compare: list[str],
    steps: int,
    warmup: int,
    output: Path,
    evaluate: bool,
    display=None,
    seeds: int = 1,
    budget: str = "equal-steps",
) -> dict:
    """Every method on the same data and model, once per seed (train.seed, +1, ...), each seed in fresh workers;
    bench.json holds each method's means, standard deviations and per-seed values."""
    names = method_names(recipe, compare, budget)
    if recipe.data.user == "all":
        raise BadInput("data.user: bench times one training run per method; use data.user=null (pooled) or a user id")
    if recipe.backend != "cpu" and any(map(is_hf_trainer, names)):
        raise BadInput("--compare hf-trainer runs on the cpu backend only")
    if budget == "equal-time" and any(map(is_hf_trainer, names)):
        raise BadInput("--budget equal-time: hf-trainer runs a fixed number of steps; compare it at equal-steps")
    seed_values = [recipe.train.seed + i for i in range(seeds)]
    per_seed, rows, probe = [], [], None
    for seed in seed_values:
        seeded = replace_key(recipe, "train.seed", seed)
        recipes = {name: method_recipe(seeded, name, warmup + steps) for name in names}
        adapters = output / "adapters" / f"seed-{seed}" if evaluate else None
        shown = display and (lambda name, row, seed=seed: display(f"seed {seed} {name}", row))
        session, probed = run_session(recipes, steps, warmup, budget, evaluate, adapters, shown, probe is None)
        # measured once, before the first seed's steps
        probe = probe or probed
        per_seed.append(
            summarize_bench(
                names,
                {n: s["timed"] for n, s in session.items()},
                {n: s["rows"] for n, s in session.items()},
                {n: s["eval"] for n, s in session.items()},
                {n: s["memory"] for n, s in session.items()},
                {n: compute_dtype(r, hf_trainer_bf16(n)) for n, r in recipes.items()},
                probe["matmul_limit_gflops"],
            )
        )
        rows.append({n: s["rows"] for n, s in session.items()})
    result = {**combine_seeds(per_seed, seed_values), "budget": budget, "steps": steps, "warmup": warmup, **probe}
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / "bench.json", result)
    write_text_atomic(output / "bench.md", bench_markdown(result, recipe, steps, warmup))
    plot_loss_curves(rows, output / "loss_curves.png")
    return result


def summarize_bench(
    names: list[str],
    timed: dict[str, list[dict]],
    all_rows: dict[str, list[dict]],
    evals: dict,
    memory: dict | None = None,
    dtypes: dict[str, str] | None = None,
    limits: dict[str, float] | None = None,
) -> dict:
    """bench.json: each method's step_stats over its timed steps; `diverged` and the eval over all of them; its
    model GFLOP/s against the matmul limit (`limits`, by dtype) of the dtype it computes in (`dtypes`)."""
    baseline = BASELINE if BASELINE in names else names[0]
    stats = {name: step_stats(timed[name]) for name in names}
    methods = []
    for name in names:
        entry = {
            "name": name,
            **stats[name],
            "eval": evals.get(name),
            "steps": len(timed[name]),
            "train_time_s": sum(row["step_time_s"] for row in timed[name]),
            "diverged": any(r.get("event") in ("diverged", "rollback") for r in all_rows[name]),
            "speedup": stats[baseline]["median_step_time_s"] / stats[name]["median_step_time_s"],
            "memory": (memory or {}).get(name),
            "compute_dtype": (dtypes or {}).get(name),
            **roofline_fields(
                timed[name], stats[name]["median_step_time_s"], (limits or {}).get((dtypes or {}).get(name))
            ),
        }
        if "sim_median_step_time_s" in entry:
            entry["sim_speedup"] = stats[baseline]["sim_median_step_time_s"] / entry["sim_median_step_time_s"]
        methods.append({**entry, **_ideal_speedup(entry, stats.get(BASELINE))})
    return {"baseline": baseline, "methods": methods}


def _ideal_speedup(entry: dict, full: dict | None) -> dict:
    """lcsb:K against full backprop if its backward cost exactly a K-th of full backprop's and its forward were its
    own (which records the autograd graph of the active block only): (F_full + B_full) / (F_lcsb + B_full / K)."""
    blocks = blocks_of(entry["name"])
    if blocks is None or full is None or "median_forward_s" not in full or "median_forward_s" not in entry:
        return {}
    ideal = (full["median_forward_s"] + full["median_backward_s"]) / (
        entry["median_forward_s"] + full["median_backward_s"] / blocks
    )
    return {"ideal_speedup": ideal, "efficiency": entry["speedup"] / ideal}
