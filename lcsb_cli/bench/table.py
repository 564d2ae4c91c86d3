"""bench's tables, built once from bench.json's result and rendered as markdown (bench.md) and rich (the terminal)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..recipe import Recipe

IDEAL = (
    "lcsb:K's ideal speedup = (F_full + B_full) / (F_lcsb + B_full / K), F and B the forward and backward "
    "medians of full backprop and of that lcsb:K: its step time if its backward cost exactly a K-th of full "
    "backprop's; efficiency = speedup / ideal speedup."
)
ROOFLINE = (
    "GFLOP/s = model FLOPs per step (counted from the shapes: forward and the backward the method "
    "differentiates, no recomputation) / median step time; of limit = its share of this machine's matmul "
    "GFLOP/s at the model's projection shapes, in the dtype the method computes in"
)
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
MEMORY_COLUMNS = {
    "peak_rss_mb": "peak RSS",
    "runtime_mb": "runtime",
    "weights_mb": "weights",
    "lora_optimizer_mb": "LoRA + optimizer",
    "activations_mb": "activations",
    "logits_mb": "logits",
    "other_mb": "other",
}


@dataclass
class BenchTable:
    title: str
    columns: list[str]
    rows: list[list[str]]


def bench_tables(result: dict, recipe: Recipe) -> list[BenchTable]:
    """The per-method table, forward and backward, the simulated phone's (npu-sim) and the peak-RSS breakdown, each
    when some method has its figures."""
    methods = result["methods"]
    tables = [_main(methods, result["baseline"])]
    if len(result.get("seeds", [])) > 1:
        tables.append(_per_seed(methods))
    if any("median_forward_s" in m for m in methods):
        tables.append(_split(methods))
    if any("sim_median_step_time_s" in m for m in methods):
        tables.append(_simulated(methods, recipe))
    if any(m.get("memory") for m in methods):
        tables.append(_memory(methods))
    return tables


def bench_markdown(result: dict, recipe: Recipe, steps: int, warmup: int) -> str:
    lines = [
        f"# lcsb bench: {recipe.name}",
        "",
        f"Model {recipe.model.name} ({recipe.model.dtype}, quantization {recipe.quantization}), batch "
        f"{recipe.train.batch_size}, autocast {recipe.train.autocast}, backend {recipe.backend}; "
        f"{_budget(result, steps)} after {warmup} warm-up steps, interleaved; seeds "
        f"{', '.join(map(str, result['seeds']))}; baseline {result['baseline']}.",
        "",
    ]
    if any("ideal_speedup" in m for m in result["methods"]):
        lines += [IDEAL, ""]
    if "matmul_limit_gflops" in result:
        lines += [limits_line(result) + " " + ROOFLINE + ".", ""]
    for table in bench_tables(result, recipe):
        lines += [f"{table.title}:", "", *markdown_lines(table), ""]
    return "\n".join(lines)


def markdown_lines(table: BenchTable) -> list[str]:
    return [_markdown_row(table.columns), "|" + " --- |" * len(table.columns), *map(_markdown_row, table.rows)]


def bench_rich(result: dict, recipe: Recipe) -> Group:
    limits = [Text(limits_line(result))] if "matmul_limit_gflops" in result else []
    return Group(*(rich_table(table) for table in bench_tables(result, recipe)), *limits)


def rich_table(table: BenchTable) -> Table:
    rendered = Table(title=table.title)
    for index, column in enumerate(table.columns):
        rendered.add_column(column, justify="left" if index == 0 else "right", no_wrap=index == 0)
    for row in table.rows:
        rendered.add_row(*row)
    return rendered


def _budget(result: dict, steps: int) -> str:
    if result.get("budget") == "equal-time":
        return f"equal time (each method trains as long as full backprop's {steps} timed steps)"
    return f"{steps} timed steps per method"


def limits_line(result: dict) -> str:
    """The matmul limits, the bf16 one with the host's kind beside it: an emulated bf16 limit is no CPU's bf16."""
    probe = result["matmul_probe"]
    shapes = ", ".join("x".join(map(str, s)) for s in probe["shapes"])
    host = f" ({probe.get('host', 'host kind unknown')})"
    rates = ", ".join(
        f"{SHORT_DTYPES.get(d, d)} {g:.1f}{host if d == 'bfloat16' else ''}"
        for d, g in result["matmul_limit_gflops"].items()
    )
    return f"Matmul limit (GFLOP/s, GEMMs M x K x N {shapes}, {probe['threads']} threads): {rates}."


def _roofline(m: dict) -> str:
    if "achieved_gflops" not in m:
        return ""
    return f"{m['achieved_gflops']:.1f} ({m['roofline_fraction']:.0%} of {SHORT_DTYPES[m['compute_dtype']]})"


def _headline(evals: list[dict]) -> str:
    return next((key for key in ("accuracy", "rougeL", "perplexity") if any(key in e for e in evals)), "accuracy")


def _main(methods: list[dict], baseline: str) -> BenchTable:
    """Means over the seeds, with ± one standard deviation where there are several."""
    evals = [m["eval"] or {} for m in methods]
    headline = _headline(evals)
    columns = [
        "method",
        "steps",
        "median step (s)",
        "tokens/s",
        "peak RSS (MB)",
        "final loss",
        "speedup",
        "eval loss",
        f"eval {headline}",
    ]
    roofline = any("achieved_gflops" in m for m in methods)
    if roofline:
        columns.insert(4, "GFLOP/s (of limit)")
    rows = []
    for m, e in zip(methods, evals):
        spread = m.get("std", {})
        eval_spread = spread.get("eval") or {}
        rows.append(
            [
                m["name"],
                f"{m['steps']:g}",
                f"{m['median_step_time_s']:.3f}",
                f"{m['tokens_per_s']:.0f}",
                *([_roofline(m)] if roofline else []),
                f"{m['peak_mem_mb']:.0f}",
                _pm(m["final_loss"], spread.get("final_loss"), "{:.4f}"),
                f"{m['speedup']:.2f}x",
                _pm(e.get("loss"), eval_spread.get("loss"), "{:.4f}"),
                _pm(e.get(headline), eval_spread.get(headline), "{:.3f}"),
            ]
        )
    return BenchTable(f"Per method (medians over the timed steps; speedup against {baseline})", columns, rows)


def _per_seed(methods: list[dict]) -> BenchTable:
    headline = _headline([s["eval"] or {} for m in methods for s in m["seeds"]])
    rows = [
        [
            m["name"],
            str(s["seed"]),
            str(s["steps"]),
            f"{s['train_time_s']:.1f}",
            f"{s['final_loss']:.4f}",
            _cell((s["eval"] or {}).get("loss"), "{:.4f}"),
            _cell((s["eval"] or {}).get(headline), "{:.3f}"),
        ]
        for m in methods
        for s in m["seeds"]
    ]
    columns = ["method", "seed", "steps", "train time (s)", "final loss", "eval loss", f"eval {headline}"]
    return BenchTable("Per seed", columns, rows)


def _pm(value: float | None, spread: float | None, template: str) -> str:
    if value is None:
        return ""
    return template.format(value) + (f" ± {template.format(spread)}" if spread else "")


def _split(methods: list[dict]) -> BenchTable:
    """Methods whose steps have a forward and a backward pass (not mezo, not hf-trainer's own loop)."""
    rows = [
        [
            m["name"],
            f"{m['median_forward_s']:.3f}",
            f"{m['median_backward_s']:.3f}",
            _cell(m.get("ideal_speedup"), "{:.2f}x"),
            _cell(m.get("efficiency"), "{:.2f}"),
        ]
        for m in methods
        if "median_forward_s" in m
    ]
    columns = ["method", "forward (s)", "backward (s)", "ideal speedup", "efficiency"]
    return BenchTable("Forward and backward (medians)", columns, rows)


def _simulated(methods: list[dict], recipe: Recipe) -> BenchTable:
    columns = [
        "method",
        "sim step (ms)",
        "NPU lane (ms)",
        "CPU lane (ms)",
        "GPU trainer (ms)",
        "CPU trainer (ms)",
        "sim energy (mJ/step)",
        "NPU util",
        "sim speedup",
    ]
    rows = [
        [
            m["name"],
            f"{m['sim_median_step_time_s'] * 1e3:.2f}",
            *(_milliseconds(m.get(f"sim_median_{key}_s")) for key in ("npu", "cpu", "gpu_trainer", "cpu_trainer")),
            f"{m['sim_median_energy_j'] * 1e3:.1f}",
            f"{m['npu_util']:.2f}",
            f"{m['sim_speedup']:.2f}x",
        ]
        for m in methods
        if "sim_median_step_time_s" in m
    ]
    title = f"Simulated on-device (npu-sim, {recipe.npu_sim.device}, {recipe.npu_sim.weights} weights)"
    return BenchTable(title, columns, rows)


def _memory(methods: list[dict]) -> BenchTable:
    """Methods without a breakdown (hf-trainer: HF's own loop, which the engine's probes do not see) are left out."""
    rows = [[m["name"], *(f"{m['memory'][key]:.0f}" for key in MEMORY_COLUMNS)] for m in methods if m.get("memory")]
    title = "Peak RSS breakdown (MB; other = allocator slack, transient dequantized weights, data, late imports)"
    return BenchTable(title, ["method", *MEMORY_COLUMNS.values()], rows)


def _cell(value: float | None, template: str) -> str:
    return "" if value is None else template.format(value)


def _milliseconds(seconds: float | None) -> str:
    return _cell(None if seconds is None else seconds * 1e3, "{:.2f}")


def _markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
