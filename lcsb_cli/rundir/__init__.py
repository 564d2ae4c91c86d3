"""The run directory, a room below the training run: its layout and writer lock (layout.py), who claims it and what
a resume may change (ownership.py), checkpoints (checkpoint.py), the metrics log (metrics.py) and its summary
(summary.py), and the command-line targets that name a run (targets.py)."""

from .layout import RunDir
from .metrics import read_metrics, truncate_metrics
from .ownership import RESUMABLE_CHANGES, check_fresh, check_output_dir, check_resume, claim, opened_run
from .targets import finished_run, resolve_target

__all__ = [
    "RESUMABLE_CHANGES",
    "RunDir",
    "check_fresh",
    "check_output_dir",
    "check_resume",
    "claim",
    "finished_run",
    "opened_run",
    "read_metrics",
    "resolve_target",
    "truncate_metrics",
]
