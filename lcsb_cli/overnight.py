"""Job control for a background run: the night's window, a time limit, graceful signals, thermal back-off.

The engine asks `Job.stop_reason()` before each step and `Job.cool_down()` before each step; a stop
checkpoints and exits 0, and `--resume` continues exactly. `job.json` in the run dir keeps what the morning
report needs across interruptions: interruptions, resumes, time throttled and waiting, eval before training.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import write_json_atomic
from .errors import BadInput

COOL_MARGIN_C = 2.0  # a paused job resumes this far below overnight.max_temp_c
POLL_S = 5.0  # real sensors: seconds between readings while paused
SIM_POLL_S = 10.0  # npu-sim: simulated seconds of idle cooling per reading
THERMAL_ZONES = "/sys/class/thermal/thermal_zone*/temp"  # millidegrees C


@dataclass(frozen=True)
class Window:
    start: dt.time
    end: dt.time

    def contains(self, now: dt.datetime) -> bool:
        t = now.time()
        if self.start < self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end  # across midnight

    def seconds_until_start(self, now: dt.datetime) -> float:
        return 0.0 if self.contains(now) else _seconds_until(now, self.start)

    def seconds_until_end(self, now: dt.datetime) -> float:
        return _seconds_until(now, self.end) if self.contains(now) else 0.0


def _seconds_until(now: dt.datetime, at: dt.time) -> float:
    target = now.replace(hour=at.hour, minute=at.minute, second=0, microsecond=0)
    if target <= now:
        target += dt.timedelta(days=1)
    return (target - now).total_seconds()


def parse_window(text: str) -> Window:
    """"HH:MM-HH:MM" (the end may be earlier than the start: the window crosses midnight)."""
    try:
        start, end = (dt.time.fromisoformat(part.strip()) for part in text.split("-"))
    except ValueError:
        raise BadInput(f"overnight.window: {text!r} is not HH:MM-HH:MM, e.g. \"01:00-06:00\"") from None
    if start == end:
        raise BadInput(f"overnight.window: {text!r} starts and ends at the same time; leave it unset for no window")
    return Window(start, end)


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


def read_temperature(backend) -> float | None:
    """npu-sim: the simulated phone; cuda: the GPU's own sensor; else the hottest Linux thermal zone, if any."""
    if hasattr(backend, "device_model"):
        return backend.device_model.temp_c
    if backend.name == "cuda":
        import torch

        try:
            return float(torch.cuda.temperature(backend.device))
        except Exception:  # no NVML / no sensor: fall through to the host's zones
            pass
    readings = []
    for path in glob.glob(THERMAL_ZONES):
        try:
            readings.append(int(Path(path).read_text()) / 1000)
        except (OSError, ValueError):
            continue
    return max(readings) if readings else None


class Job:
    """One process's share of a background run; its totals accumulate in run_dir/job.json."""

    def __init__(self, config, run_dir: Path, clock=time.monotonic, now=dt.datetime.now, sleep=time.sleep,
                 writes: bool = True):
        self.config, self.path, self.writes = config, run_dir / "job.json", writes
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
        if self.writes:  # with several ranks, rank 0 keeps the job's file
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
        temp = start = read_temperature(backend) if limit else None
        if temp is None or temp <= limit:
            return None
        paused = 0.0
        while temp is not None and temp > limit - COOL_MARGIN_C and not self.signals.requested:
            if hasattr(backend, "device_model"):  # simulated cool-down: idle power, no real sleep
                backend.device_model.advance(SIM_POLL_S, backend.profile.idle_power_w)
                paused += SIM_POLL_S
            else:
                self.sleep(POLL_S)
                paused += POLL_S
            previous, temp = temp, read_temperature(backend)
            if hasattr(backend, "device_model") and temp > previous - 1e-3:
                break  # idle is as cool as this profile gets
        self.state["throttled_s"] += paused
        return {"temp_c": start, "paused_s": paused}

    def interrupted(self, step: int, reason: str) -> None:
        self.state["interruptions"].append({"step": step, "reason": reason, "at": self.now().isoformat(timespec="seconds")})


def write_report(run_dir: Path, recipe, state: dict, summary: dict, eval_after: dict | None,
                 adapter_dir: Path) -> dict:
    """The morning report: report.json and the same as report.md (`eval_after` is None after a signal: the job
    exits at once and the run's next finish evaluates)."""
    from .checkpoint import write_text_atomic
    from .data import personal_data

    skipped = personal_data(recipe).skipped if recipe.data.format == "jsonl" else []
    report = {
        "steps": summary["steps"], "max_steps": recipe.train.max_steps, "finished": not summary.get("stopped"),
        "stopped": summary.get("stopped"), "wall_time_s": summary["wall_time_s"],
        "throttled_s": state["throttled_s"], "waited_s": state["waited_s"], "interruptions": state["interruptions"],
        "resumes": state["resumes"], "eval_before": state["eval_before"], "eval_after": eval_after,
        "lines_skipped": len(skipped), "skipped": [{"line": line, "reason": reason} for line, reason in skipped],
        "adapter": str(adapter_dir), "events": summary["events"],
    }
    write_json_atomic(run_dir / "report.json", report)
    write_text_atomic(run_dir / "report.md", report_markdown(report, recipe))
    return report


def report_markdown(report: dict, recipe) -> str:
    before, after = report["eval_before"], report["eval_after"]
    status = "finished" if report["finished"] else f"stopped ({report['stopped']}); continue with --resume"
    lines = [
        f"# Overnight report: {recipe.name}", "",
        f"- steps: {report['steps']} of {report['max_steps']}, {status}",
        f"- wall time: {report['wall_time_s'] / 60:.1f} min; throttled {report['throttled_s']:.0f} s; "
        f"waited for the window {report['waited_s']:.0f} s",
        f"- interruptions: {len(report['interruptions'])}; resumes: {report['resumes']}",
        f"- data lines skipped: {report['lines_skipped']}",
        f"- adapter: {report['adapter']}", "",
        "| held-out newest items | accuracy | macro-F1 |", "| --- | --- | --- |",
        f"| before training | {before['accuracy']:.3f} | {before['macro_f1']:.3f} |",
        f"| after training | {after['accuracy']:.3f} | {after['macro_f1']:.3f} |" if after else
        "| after training | not evaluated: stopped by a signal | |",
    ]
    lines += [""] * bool(report["interruptions"])
    lines += [f"- interrupted at step {i['step']} by {i['reason']} ({i['at']})" for i in report["interruptions"]]
    return "\n".join(lines) + "\n"
