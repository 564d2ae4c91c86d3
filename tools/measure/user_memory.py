"""Per-user memory of a per-user run (issue 48): each user's peak RSS, what earlier users left behind, the run's peak.

    python tools/measure/user_memory.py USERS [--clones] [--alone] [KEY=VALUE ...]

Writes the synthetic LaMP-2 sample's first USERS users (the shipped generator, more users when USERS > 30) to a
scratch directory, trains `recipes/lamp2.yaml` on them with the overrides in one process, and prints one JSON line:
- `peaks`: each user's VmHWM (peak since that user began), then the final evaluation's (its own peak);
- `ends`: the RSS as each user ends (its model still loaded), then the run's;
- `left`: the RSS as each user begins, after the users before it were freed: what they left behind;
- `run_peak`: summary.json's peak, the process's with the final evaluation.

`--clones`: USERS copies of the first user (its profile and questions under new ids), so every user does the same
work and a rise in `peaks` is memory that grows with the number of users, not a user with longer items.
`--alone`: also each user's run peak with that user alone, each in a fresh process (`alone`), the figure its
`peaks` entry would have if nothing came before it."""

from __future__ import annotations

import json
import subprocess
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

_FILES = {
    "train": "train_questions.json",
    "train_labels": "train_outputs.json",
    "eval": "dev_questions.json",
    "eval_labels": "dev_outputs.json",
}


class EachUser(SilentDisplay):
    def __init__(self):
        self.peaks: list[float] = []
        self.ends: list[float] = []
        self.left: list[float] = []

    def for_user(self, user_id):
        # called after the earlier users' memory was released and the peak reset
        self.left.append(round(rss_mb(), 1))
        return self

    def on_end(self, summary):
        self.peaks.append(round(peak_rss_mb(), 1))
        self.ends.append(round(rss_mb(), 1))
        reset_peak_rss()


def sample(users: int, clones: bool) -> dict:
    """The generator's files cut to `users` users, or `users` clones of its first user."""
    synthetic.N_USERS = max(1 if clones else users, synthetic.N_USERS)
    files = synthetic.generate(0)
    first = min(q["user_id"] for q in files["dev_questions.json"])
    kept = {first} if clones else set(sorted({q["user_id"] for q in files["dev_questions.json"]})[:users])
    out = {}
    for split in ("train", "dev"):
        golds = {g["id"]: g["output"] for g in files[f"{split}_outputs.json"]["golds"]}
        questions = [q for q in files[f"{split}_questions.json"] if q["user_id"] in kept]
        if clones:
            questions = [
                {**q, "id": f"{q['id']}-{copy}", "user_id": f"clone_{copy:03d}"}
                for copy in range(users)
                for q in questions
            ]
        out[f"{split}_questions.json"] = questions
        golds_kept = [{"id": q["id"], "output": golds[q["id"].split("-")[0]]} for q in questions]
        out[f"{split}_outputs.json"] = {"task": "LaMP_2", "golds": golds_kept}
    return out


def write_sample(files: dict, directory: Path, user: str | None = None) -> Path:
    """The files in `directory`, only `user`'s items when given."""
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        questions = [q for q in files[f"{split}_questions.json"] if user in (None, q["user_id"])]
        ids = {q["id"] for q in questions}
        golds = [g for g in files[f"{split}_outputs.json"]["golds"] if g["id"] in ids]
        (directory / f"{split}_questions.json").write_text(json.dumps(questions))
        (directory / f"{split}_outputs.json").write_text(json.dumps({"task": "LaMP_2", "golds": golds}))
    return directory


def measure(data: Path, overrides: list[str]) -> dict:
    """Train the recipe on the sample in `data`, in this process."""
    paths = [f"data.{key}={data / name}" for key, name in _FILES.items()]
    recipe = load_recipe(REPO / "recipes" / "lamp2.yaml", [*paths, f"output_dir={data / 'run'}", *overrides])
    each = EachUser()
    summary = train(recipe, Path(recipe.output_dir), each)
    return {"peaks": each.peaks, "ends": each.ends, "left": each.left, "run_peak": round(summary["peak_mem_mb"], 1)}


def alone(files: dict, scratch: Path, overrides: list[str]) -> list[float]:
    """Each user's run peak with that user alone, each in a fresh process."""
    peaks = []
    for user in sorted({q["user_id"] for q in files["dev_questions.json"]}):
        data = write_sample(files, scratch / f"alone-{user}", user)
        proc = subprocess.run(
            [sys.executable, __file__, "--data", str(data), *overrides], capture_output=True, text=True, check=True
        )
        peaks.append(json.loads(proc.stdout.splitlines()[-1])["run_peak"])
    return peaks


def main(argv: list[str]) -> None:
    if argv[0] == "--data":
        print(json.dumps(measure(Path(argv[1]), argv[2:])))
        return
    flags = {arg for arg in argv[1:] if arg in ("--clones", "--alone")}
    overrides = [arg for arg in argv[1:] if arg not in flags]
    files = sample(int(argv[0]), "--clones" in flags)
    scratch = Path(tempfile.mkdtemp(prefix="user-memory-"))
    found = measure(write_sample(files, scratch / "all"), overrides)
    if "--alone" in flags:
        found["alone"] = alone(files, scratch, overrides)
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1:])
