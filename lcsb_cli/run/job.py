"""Job control for a background run: the night's window, a time limit, graceful signals, thermal back-off.

The engine asks `Job.stop_reason()` before each step and `Job.cool_down()` before each step; a stop
checkpoints and exits 0, and `--resume` continues exactly. `job.json` in the run dir keeps what the morning
report needs across interruptions: interruptions, resumes, time throttled and waiting, eval before training.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import time
from pathlib import Path

from ..atomic import write_json_atomic
from ..rundir import RunDir
from ..window import parse_window
from .distributed import check_parallel_method, init_world

# a paused job resumes this far below overnight.max_temp_c
COOL_MARGIN_C = 2.0


class GracefulStop:
    """While active, SIGTERM and SIGINT only set `requested`: the current step finishes, then the job stops."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Job:
    """One process's share of a background run; its totals accumulate in run_dir/job.json."""

    def __init__(
        self, config, run_dir: Path, clock=time.monotonic, now=dt.datetime.now, sleep=time.sleep, writes: bool = True
    ):
        self.config, self.path, self.writes = config, RunDir(run_dir).job, writes
        self.window = parse_window(config.window) if config.window else None
        self.clock, self.now, self.sleep = clock, now, sleep
        self.started = clock()
        self.signals = GracefulStop()
        self.state = {"interruptions": [], "resumes": 0, "throttled_s": 0.0, "waited_s": 0.0, "eval_before": None}

    def load(self, resume: bool) -> None:
        if resume and self.path.is_file():
            self.state = json.loads(self.path.read_text())
            self.state["resumes"] += 1

    def save(self) -> None:
        # with several ranks, rank 0 keeps the job's file
        if self.writes:
            write_json_atomic(self.path, self.state)

    def wait_for_window(self) -> str | None:
        """Sleep until the window opens (a signal ends the wait: returns its name)."""
        if self.window is None:
            return None
        while (left := self.window.seconds_until_start(self.now())) > 0 and not self.signals.requested:
            nap = min(left, 60.0)
            self.sleep(nap)
            self.state["waited_s"] += nap
        return self.signals.requested

    def stop_reason(self) -> str | None:
        if self.signals.requested:
            return self.signals.requested
        if self.config.max_minutes and self.clock() - self.started >= self.config.max_minutes * 60:
            return "max_minutes"
        if self.window is not None and not self.window.contains(self.now()):
            return "window_end"
        return None

    def cool_down(self, backend) -> dict | None:
        """Pause while the device is above overnight.max_temp_c: {"temp_c", "paused_s"}, or None if cool enough."""
        limit = self.config.max_temp_c
        temp = start = backend.temperature() if limit else None
        if temp is None or temp <= limit:
            return None
        paused = 0.0
        while temp is not None and temp > limit - COOL_MARGIN_C and not self.signals.requested:
            cooling = backend.idle(backend.idle_poll_s, self.sleep)
            paused += backend.idle_poll_s
            temp = backend.temperature()
            if not cooling:
                break
        self.state["throttled_s"] += paused
        return {"temp_c": start, "paused_s": paused}

    def interrupted(self, step: int, reason: str) -> None:
        self.state["interruptions"].append(
            {"step": step, "reason": reason, "at": self.now().isoformat(timespec="seconds")}
        )


@contextlib.contextmanager
def owned_job(recipe, run_dir: Path):
    """This process's world (torchrun's, or a single process) and its job for one run, with the job's signal
    handlers installed while the run is active."""
    world = init_world(recipe.backend)
    if world.size > 1:
        check_parallel_method(recipe.method)
    job = Job(recipe.overnight, run_dir, writes=world.is_main)
    with job.signals:
        yield job, world


def write_report(
    run_dir: Path,
    recipe,
    state: dict,
    summary: dict,
    eval_after: dict | None,
    adapter_dir: Path,
    skipped: list[tuple[int, str]],
) -> dict:
    """The morning report: report.json and the same as report.md (`eval_after` is None after a signal: the job
    exits at once and the run's next finish evaluates)."""
    from ..atomic import write_text_atomic

    report = {
        "steps": summary["steps"],
        "max_steps": summary.get("max_steps", recipe.train.max_steps),
        "finished": not summary.get("stopped"),
        "stopped": summary.get("stopped"),
        "wall_time_s": summary["wall_time_s"],
        "throttled_s": state["throttled_s"],
        "waited_s": state["waited_s"],
        "interruptions": state["interruptions"],
        "resumes": state["resumes"],
        "eval_before": state["eval_before"],
        "eval_after": eval_after,
        "lines_skipped": len(skipped),
        "skipped": [{"line": line, "reason": reason} for line, reason in skipped],
        "adapter": str(adapter_dir),
        "events": summary["events"],
    }
    write_json_atomic(RunDir(run_dir).report_json, report)
    write_text_atomic(RunDir(run_dir).report_md, report_markdown(report, recipe))
    return report


def report_markdown(report: dict, recipe) -> str:
    before, after, events = report["eval_before"], report["eval_after"], report["events"]
    keys = [k for k in ("accuracy", "macro_f1", "exact_match", "rouge1", "rougeL", "loss", "perplexity") if k in before]
    status = "finished" if report["finished"] else f"stopped ({report['stopped']}); continue with --resume"
    lines = [
        f"# Overnight report: {recipe.name}",
        "",
        f"- steps: {report['steps']} of {report['max_steps']}, {status}",
        f"- wall time: {report['wall_time_s'] / 60:.1f} min; throttled {report['throttled_s']:.0f} s; "
        f"waited for the window {report['waited_s']:.0f} s",
        f"- heat: {events.get('throttled', 0)} cool-down pauses; NPU clock throttled "
        f"{events.get('npu_clock_throttled', 0)} times, restored {events.get('npu_clock_restored', 0)}",
        f"- interruptions: {len(report['interruptions'])}; resumes: {report['resumes']}",
        f"- data lines skipped: {report['lines_skipped']}",
        f"- adapter: {report['adapter']}",
        "",
        "| held-out items | " + " | ".join(keys) + " |",
        "|" + " --- |" * (len(keys) + 1),
        "| before training | " + " | ".join(f"{before[k]:.3f}" for k in keys) + " |",
        "| after training | " + " | ".join(f"{after[k]:.3f}" for k in keys) + " |"
        if after
        else "| after training | not evaluated: stopped by a signal |" + " |" * (len(keys) - 1),
    ]
    lines += [""] * bool(report["interruptions"])
    lines += [f"- interrupted at step {i['step']} by {i['reason']} ({i['at']})" for i in report["interruptions"]]
    return "\n".join(lines) + "\n"
