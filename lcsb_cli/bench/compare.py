"""`lcsb bench`: the recipe's method and each compared method on the same data, seed and model, with
interleaved timed steps, one worker process per method."""

from __future__ import annotations

import multiprocessing
import statistics
from pathlib import Path

from ..atomic import write_json_atomic, write_text_atomic
from ..errors import BadInput
from ..recipe import Recipe, replace_key, to_dict

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
    medians = {n: statistics.median(r["step_time_s"] for r in timed[n]) for n in names}
    baseline = BASELINE if BASELINE in names else names[0]
    result = {"baseline": baseline, "methods": []}
    base_rows = timed[baseline]
    if baseline == BASELINE and "forward_s" in base_rows[0]:
        result["forward_s"] = statistics.median(r["forward_s"] for r in base_rows)
        result["backward_s"] = statistics.median(r["backward_s"] for r in base_rows)
    for name in names:
        rows = timed[name]
        entry = {
            "name": name, "median_step_time_s": medians[name],
            "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in all_rows[name]),
            "final_loss": all_rows[name][-1]["loss"], "eval": evals.get(name),
            "diverged": any(r.get("event") in ("diverged", "rollback") for r in all_rows[name]),
            "speedup": medians[baseline] / medians[name], "memory": (memory or {}).get(name),
        }
        if "sim_step_time_s" in rows[0]:
            entry.update(_simulated(rows, timed[baseline]))
        if (k := lcsb_blocks(name)) is not None and "forward_s" in result:
            f, b = result["forward_s"], result["backward_s"]
            entry["ceiling"] = (f + b) / (f + b / k)
            entry["efficiency"] = entry["speedup"] / entry["ceiling"]
        result["methods"].append(entry)
    return result


def _simulated(rows: list[dict], baseline_rows: list[dict]) -> dict:
    """npu-sim: the simulated phone's medians, and the speedup on the phone against the baseline."""
    medians = {k: statistics.median(r[k] for r in rows) for k in ("sim_step_time_s", "sim_energy_j", "npu_util")}
    base = statistics.median(r["sim_step_time_s"] for r in baseline_rows)
    return {**medians, "sim_speedup": base / medians["sim_step_time_s"]}


def bench_markdown(result: dict, recipe: Recipe, steps: int, warmup: int) -> str:
    lines = [f"# lcsb bench: {recipe.name}", "",
             f"Model {recipe.model.name} ({recipe.model.dtype}, quantization {recipe.quantization}), batch "
             f"{recipe.train.batch_size}, autocast {recipe.train.autocast}, backend {recipe.backend}; {steps} timed "
             f"steps per method after {warmup} warm-up steps, interleaved; baseline {result['baseline']}.", ""]
    if "forward_s" in result:
        lines += [f"Full backprop: forward {result['forward_s']:.3f} s, backward {result['backward_s']:.3f} s "
                  "(medians); an lcsb:K ceiling is (F+B)/(F+B/K).", ""]
    lines += ["| method | median step (s) | tokens/s | peak RSS (MB) | final loss | speedup | efficiency | eval acc |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in result["methods"]:
        eff = f"{m['efficiency']:.2f}" if "efficiency" in m else ""
        acc = f"{m['eval']['accuracy']:.3f}" if m["eval"] else ""
        lines.append(f"| {m['name']} | {m['median_step_time_s']:.3f} | {m['tokens_per_s']:.0f} | "
                     f"{m['peak_mem_mb']:.0f} | {m['final_loss']:.4f} | {m['speedup']:.2f}x | {eff} | {acc} |")
    if "sim_step_time_s" in result["methods"][0]:
        lines += ["", f"Simulated on-device (npu-sim, {recipe.npu_sim.device}, {recipe.npu_sim.weights} weights):", "",
                  "| method | sim step (ms) | sim energy (mJ/step) | NPU util | sim speedup |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {m['name']} | {m['sim_step_time_s'] * 1e3:.2f} | {m['sim_energy_j'] * 1e3:.1f} | "
                  f"{m['npu_util']:.2f} | {m['sim_speedup']:.2f}x |" for m in result["methods"]]
    return "\n".join(lines + memory_markdown(result["methods"])) + "\n"


MEMORY_COLUMNS = {"peak_rss_mb": "peak RSS", "runtime_mb": "runtime", "weights_mb": "weights",
                  "lora_optimizer_mb": "LoRA + optimizer", "activations_mb": "activations", "logits_mb": "logits",
                  "other_mb": "other"}


def memory_markdown(methods: list[dict]) -> list[str]:
    """The peak-RSS breakdown (memory.breakdown) per method, MB; methods without one (hf-trainer) are left out."""
    rows = [m for m in methods if m.get("memory")]
    if not rows:
        return []
    header = "| method | " + " | ".join(MEMORY_COLUMNS.values()) + " |"
    lines = ["", "Peak RSS breakdown (MB; other = allocator slack, transient dequantized weights, data, late imports):",
             "", header, "|" + " --- |" * (len(MEMORY_COLUMNS) + 1)]
    return lines + [f"| {m['name']} | " + " | ".join(f"{m['memory'][c]:.0f}" for c in MEMORY_COLUMNS) + " |"
                    for m in rows]


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
