"""Per-user memory of a per-user run (issue 48): each user's peak RSS and the RSS as it ends, on N synthetic users.

    python tools/measure/user_memory.py USERS [KEY=VALUE ...]

Writes the synthetic LaMP-2 sample's first USERS users (the shipped generator, more users when USERS > 30) to a
scratch directory, trains `recipes/lamp2.yaml` on them with the overrides in one process, and prints one JSON line:
each user's VmHWM (peak since that user began) and RSS at its end, and the process's VmHWM after the final
evaluation."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "build"))

import synthetic  # noqa: E402

from lcsb_cli.model.memory import peak_rss_mb, reset_peak_rss, rss_mb  # noqa: E402
from lcsb_cli.recipe import load_recipe  # noqa: E402
from lcsb_cli.run.entry import train  # noqa: E402
from lcsb_cli.run.hooks import SilentDisplay  # noqa: E402


class EachUser(SilentDisplay):
    def __init__(self):
        self.peaks: list[float] = []
        self.ends: list[float] = []

    def for_user(self, user_id):
        reset_peak_rss()
        return self

    def on_end(self, summary):
        self.peaks.append(round(peak_rss_mb(), 1))
        self.ends.append(round(rss_mb(), 1))


def main(users: int, overrides: list[str]) -> None:
    synthetic.N_USERS = max(users, synthetic.N_USERS)
    files = synthetic.generate(0)
    kept = sorted({q["user_id"] for q in files["dev_questions.json"]})[:users]
    data = Path(tempfile.mkdtemp(prefix="user-memory-"))
    for split in ("train", "dev"):
        questions = [q for q in files[f"{split}_questions.json"] if q["user_id"] in kept]
        ids = {q["id"] for q in questions}
        golds = [g for g in files[f"{split}_outputs.json"]["golds"] if g["id"] in ids]
        (data / f"{split}_questions.json").write_text(json.dumps(questions))
        (data / f"{split}_outputs.json").write_text(json.dumps({"task": "LaMP_2", "golds": golds}))
    paths = [f"data.{key}={data / name}" for key, name in _FILES.items()]
    recipe = load_recipe(REPO / "recipes" / "lamp2.yaml", [*paths, f"output_dir={data / 'run'}", *overrides])
    each = EachUser()
    summary = train(recipe, Path(recipe.output_dir), each)
    print(json.dumps({"peaks": each.peaks, "ends": each.ends, "run_peak": round(summary["peak_mem_mb"], 1)}))


_FILES = {
    "train": "train_questions.json",
    "train_labels": "train_outputs.json",
    "eval": "dev_questions.json",
    "eval_labels": "dev_outputs.json",
}

if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
