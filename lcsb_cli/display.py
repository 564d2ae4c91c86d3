"""What a person sees: the rich progress display and summary tables (the loop only emits rows)."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values) -> str:
    values = list(values)
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(int((v - low) / span * len(SPARKS)), len(SPARKS) - 1)] for v in values)


class RichDisplay:
    """A live progress bar on a terminal (loss trend, lr, tok/s, memory, active block); without one, plain
    mlx-lm-style lines (no glyphs, no wrapping). Held-out rows (train.eval_every) print as lines either way."""

    def __init__(self, console: Console | None = None, first_lines: list[str] | None = None):
        self.console = console or Console(stderr=True)
        # printed once the run has set up (before its header), so a refused run prints only its one error line
        self.first_lines = [line for line in first_lines or [] if line]
        self.losses: deque[float] = deque(maxlen=24)
        self.progress: Progress | None = None
        self.task = None

    def on_start(self, info: dict) -> None:
        recipe = info["recipe"]
        for line in self.first_lines:
            self.console.print(line, highlight=False, soft_wrap=True)
        self.first_lines = []
        self.console.print(
            f"[bold]{recipe.name}[/]: {recipe.method} (K={info['blocks']}) on {recipe.model.name}, "
            f"{info['layers']} layers, {info['params']:,} LoRA params, backend {recipe.backend} -> {info['run_dir']}"
            + (f" [yellow](resumed at step {info['first_step']})[/]" if info["first_step"] else ""),
            soft_wrap=True,
        )
        for note in info.get("notes", []):
            self.console.print(
                f"[yellow]warning:[/] skipped checkpoint step-{note['step']}: {note['reason']}; "
                f"resuming from step-{note['resumed_from']}",
                highlight=False,
            )
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                "train", total=recipe.train.max_steps, completed=info["first_step"], status=""
            )

    def on_step(self, row: dict) -> None:
        # a held-out row, or an event of its own
        if "loss" not in row:
            self.console.print(f"step {row['step']}: {held_out_line(row)}", highlight=False, soft_wrap=True)
            return
        if math.isfinite(row.get("loss") or math.nan):
            self.losses.append(row["loss"])
        block = "all" if row.get("active_block") is None else row["active_block"]
        trend = f" {sparkline(self.losses)}" if self.progress is not None else ""
        status = (
            f"loss {row['loss']:.4f}{trend}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  "
            f"{row['peak_mem_mb']:.0f} MB  block {block}"
            + _simulated(row)
            + (f"  [red]{row['event']}[/]" if "event" in row else "")
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=row["step"], status=status)
        else:
            self.console.print(f"step {row['step']}: {status}", highlight=False, soft_wrap=True)

    def on_end(self, summary: dict) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.console.print(key_value_table("summary", {k: v for k, v in summary.items() if not k.startswith("eval_")}))
        if summary.get("eval_before") and summary.get("eval_after"):
            self.console.print(
                what_it_bought(summary["eval_before"], summary["eval_after"]), highlight=False, soft_wrap=True
            )
        if summary.get("users") and summary.get("run_dir"):
            self.console.print(
                f"adapters saved to {summary['run_dir']}/adapters; report: {summary['run_dir']}/report.md; "
                f"next: lcsb generate {summary['run_dir']} --user ID --prompt TEXT",
                highlight=False,
                soft_wrap=True,
            )
        elif summary.get("adapter"):
            self.console.print(
                f"adapter saved to {summary['adapter']}; next: lcsb eval {summary['run_dir']}",
                highlight=False,
                soft_wrap=True,
            )

    def for_user(self, user_id: str) -> UserLine:
        return UserLine(self.console, user_id)


class UserLine:
    """One line per user of a per-user run (`data.user: all`) instead of a display per user."""

    def __init__(self, console: Console, user_id: str):
        self.console, self.user_id = console, user_id

    def on_start(self, info: dict) -> None:
        pass

    def on_step(self, row: dict) -> None:
        pass

    def on_end(self, summary: dict) -> None:
        self.console.print(
            f"{self.user_id}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"{summary['wall_time_s']:.1f} s",
            highlight=False,
        )


class Phases:
    """Progress of `lcsb eval` and `lcsb bench`: on a terminal a bar per evaluation pass with items done and items per
    second; always a plain line when each pass ends (with its rate) and one per bench step."""

    def __init__(self, console: Console):
        self.console = console

    @contextlib.contextmanager
    def __call__(self, what: str, n: int):
        start = time.perf_counter()
        if self.console.is_terminal:
            with Progress(
                TextColumn(what),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            ) as progress:
                yield _advancer(progress, progress.add_task(what, total=n, rate=""), start)
        else:
            yield lambda done: None
        seconds = time.perf_counter() - start
        self._line(f"{what}: {n} items in {seconds:.1f} s ({n / max(seconds, 1e-9):.2f}/s)")

    def bench_step(self, name: str, row: dict | None) -> None:
        """A bench worker's step row, or (None) the start of its evaluation."""
        if row is None:
            self._line(f"{name}: evaluating")
        else:
            self._line(f"{name} step {row['step']}: loss {row['loss']:.4f}, {row['step_time_s']:.2f} s")

    def _line(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)


def _advancer(progress: Progress, task, start: float):
    """`advance(k)` for one pass's bar: k more items done, and the items per second since the pass began."""
    done = 0

    def advance(k: int) -> None:
        nonlocal done
        done += k
        progress.update(task, advance=k, rate=f"{done / max(time.perf_counter() - start, 1e-9):.2f}/s")

    return advance


def what_it_bought(before: dict, after: dict) -> str:
    """`accuracy 0.511 -> 0.689 (majority 0.144), macro-F1 0.481 -> 0.653` (or the format's own metrics)."""
    names = {
        "accuracy": "accuracy",
        "macro_f1": "macro-F1",
        "exact_match": "exact match",
        "rougeL": "ROUGE-L",
        "perplexity": "perplexity",
    }
    shown = [key for key in names if key in before and key in after][:2] or ["loss"]
    parts = [f"{names.get(key, key)} {before[key]:.3f} -> {after[key]:.3f}" for key in shown]
    if "majority_accuracy" in after:
        parts[0] += f" (majority {after['majority_accuracy']:.3f})"
    return "held-out " + ", ".join(parts)


def held_out_line(row: dict) -> str:
    """`eval_loss 1.2345, eval_accuracy 0.5000`; any other row's fields as they are."""
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "step")


def _simulated(row: dict) -> str:
    if "sim_step_time_s" not in row:
        return ""
    return (
        f"  [cyan]phone {row['sim_step_time_s'] * 1e3:.1f} ms {row['sim_energy_j']:.2f} J "
        f"{row['sim_temp_c']:.1f} C NPU {row['npu_util']:.0%}[/]"
    )


def key_value_table(title: str, data: dict) -> Table:
    table = Table(title=title, show_header=False)
    for key, value in _flat(data):
        table.add_row(key, number(value) if isinstance(value, float) else str(value))
    return table


def number(value: float) -> str:
    """Plain digits for large figures (18,040 tok/s, not 1.804e+04); four significant digits otherwise."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _flat(data: dict, prefix: str = ""):
    """(dotted key, value) pairs: nested sections such as summary.json's memory breakdown one row each."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


EVAL_COLUMNS = {
    "accuracy": "accuracy",
    "margin": "mean margin",
    "base_accuracy": "base accuracy",
    "likelihood_accuracy": "likelihood accuracy",
    "macro_f1": "macro-F1",
    "majority_accuracy": "majority accuracy",
    "out_of_label": "out of label",
    "exact_match": "exact match",
    "rouge1": "ROUGE-1",
    "rougeL": "ROUGE-L",
    "loss": "loss",
    "perplexity": "perplexity",
}


def eval_table(result: dict) -> Table:
    mode = f"{result['mode']}, " if result["format"] in ("lamp2", "jsonl") else ""
    table = Table(title=f"{result['task']} eval of the {result['evaluated']} ({mode}{result['n']} held-out items)")
    shown = [key for key in EVAL_COLUMNS if key in result]
    for key in shown:
        table.add_column(EVAL_COLUMNS[key], justify="right")
    table.add_row(*(str(result[key]) if isinstance(result[key], int) else f"{result[key]:.4f}" for key in shown))
    return table
