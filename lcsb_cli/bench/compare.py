"""`lcsb bench`: the recipe's method and each compared method on the same data, seed and model, with
interleaved timed steps, one worker process per method."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from ..atomic import write_json_atomic, write_text_atomic
from ..errors import BadInput
from ..recipe import Recipe, replace_key, to_dict
from ..run.summary import step_stats
from .table import bench_markdown

FIXED = ("full-backprop", "full-backprop+ckpt", "freeze", "lisa", "mezo", "hf-trainer", "hf-trainer:bf16")
BASELINE = "full-backprop"


def method_names(recipe: Recipe, compare: list[str]) -> list[str]:
    own = f"lcsb:{recipe.lcsb.blocks}" if recipe.method == "lcsb" else recipe.method
    for name in compare:
        if name not in FIXED and lcsb_blocks(name) is None:
            raise BadInput(f"--compare: unknown method {name!r}; choose from {', '.join(FIXED)}, lcsb:K")
    return list(dict.fromkeys([own, *compare]))


def lcsb_blocks(name: str) -> int | None:
    """K of a method named `lcsb:K` (K >= 1), or None for any other name."""
    kind, _, blocks = name.partition(":")
    return int(blocks) if kind == "lcsb" and blocks.isdigit() and int(blocks) >= 1 else None


def method_recipe(recipe: Recipe, name: str) -> Recipe:
    if (blocks := lcsb_blocks(name)) is not None:
        return replace_key(replace_key(recipe, "method", "lcsb"), "lcsb.blocks", blocks)
    if name.startswith("full-backprop"):
        full = replace_key(recipe, "method", "full-backprop")
        return replace_key(full, "activation_checkpointing", name == "full-backprop+ckpt")
    if name.startswith("hf-trainer"):  # the users' alternative in its own setup: fp32 weights, Trainer's precision
        plain = replace_key(replace_key(recipe, "activation_checkpointing", False), "model.dtype", "float32")
        return replace_key(plain, "train.autocast", "none")
    return replace_key(recipe, "method", name)


def run_bench(recipe: Recipe, compare: list[str], steps: int, warmup: int, output: Path, evaluate: bool,
              reporter=None) -> dict:
    names = method_names(recipe, compare)
    if recipe.data.user == "all":
        raise BadInput("data.user: bench times one training run per method; use data.user=null (pooled) or a user id")
    if recipe.backend != "cpu" and any(n.startswith("hf-trainer") for n in names):
        raise BadInput("--compare hf-trainer runs on the cpu backend only")
    workers = {name: _Worker(name, method_recipe(recipe, name), warmup + steps) for name in names}
    try:
        for worker in workers.values():
            worker.setup = worker.receive()
        for index in range(warmup + steps):
            for name, worker in workers.items():  # interleaved: A B C A B C ...
                row = worker.ask("step", index)
                worker.rows.append(row)
                if reporter:
                    reporter(name, row)
        memory = {name: worker.ask("memory", None) for name, worker in workers.items()}
        evals = {name: worker.ask("eval", None) if evaluate else None for name, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    result = summarize_bench(names, {n: w.rows[warmup:] for n, w in workers.items()},
                             {n: w.rows for n, w in workers.items()}, evals, memory)
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / "bench.json", result)
    write_text_atomic(output / "bench.md", bench_markdown(result, recipe, steps, warmup))
    plot_loss_curves({n: w.rows for n, w in workers.items()}, output / "loss_curves.png")
    return result


class _Worker:
    def __init__(self, name: str, recipe: Recipe, total_steps: int):
        from .workers import hf_trainer_worker, lcsb_worker

        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        if name.startswith("hf-trainer"):
            target, args = hf_trainer_worker, (child, to_dict(recipe), name.endswith(":bf16"), total_steps)
        else:
            target, args = lcsb_worker, (child, to_dict(recipe))
        self.process = context.Process(target=target, args=args, daemon=True)
        self.process.start()
        self.rows: list[dict] = []
        self.setup: dict = {}

    def ask(self, command: str, arg):
        self.conn.send((command, arg))
        return self.receive()

    def receive(self):
        try:
            if self.conn.poll(3600):
                return self.conn.recv()
        except EOFError:
            pass
        raise RuntimeError(f"the bench worker for {self.name} stopped (its error is printed above)")

    def close(self) -> None:
        try:
            self.conn.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def summarize_bench(names: list[str], timed: dict[str, list[dict]], all_rows: dict[str, list[dict]],
                    evals: dict, memory: dict | None = None) -> dict:
    """bench.json: each method's step_stats over its timed steps; `diverged` and the eval over all of them."""
    baseline = BASELINE if BASELINE in names else names[0]
    stats = {name: step_stats(timed[name]) for name in names}
    methods = []
    for name in names:
        entry = {"name": name, **stats[name], "eval": evals.get(name),
                 "diverged": any(r.get("event") in ("diverged", "rollback") for r in all_rows[name]),
                 "speedup": stats[baseline]["median_step_time_s"] / stats[name]["median_step_time_s"],
                 "memory": (memory or {}).get(name)}
        if "sim_median_step_time_s" in entry:
            entry["sim_speedup"] = stats[baseline]["sim_median_step_time_s"] / entry["sim_median_step_time_s"]
        methods.append({**entry, **_ideal_speedup(entry, stats.get(BASELINE))})
    return {"baseline": baseline, "methods": methods}


def _ideal_speedup(entry: dict, full: dict | None) -> dict:
    """lcsb:K against full backprop if its backward cost exactly a K-th of full backprop's and its forward were its
    own (which records the autograd graph of the active block only): (F_full + B_full) / (F_lcsb + B_full / K)."""
    blocks = lcsb_blocks(entry["name"])
    if blocks is None or full is None or "median_forward_s" not in full or "median_forward_s" not in entry:
        return {}
    ideal = (full["median_forward_s"] + full["median_backward_s"]) / (
        entry["median_forward_s"] + full["median_backward_s"] / blocks)
    return {"ideal_speedup": ideal, "efficiency": entry["speedup"] / ideal}


def plot_loss_curves(rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, method_rows in rows.items():
        losses = [r["loss"] for r in method_rows]
        clock = [sum(r["step_time_s"] for r in method_rows[: i + 1]) for i in range(len(method_rows))]
        by_step.plot(range(1, len(losses) + 1), losses, label=name)
        by_time.plot(clock, losses, label=name)
    by_step.set(xlabel="step", ylabel="training loss", title="loss vs step")
    by_time.set(xlabel="training time (s)", ylabel="training loss", title="loss vs wall time")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
