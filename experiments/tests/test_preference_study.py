"""experiments/preference_study.py's data split and budgets: what docs/RESULTS.md's preference study rests on."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "preference_study", Path(__file__).resolve().parents[1] / "preference_study.py"
)
preference_study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(preference_study)


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_validation_takes_every_fifth_pair_and_its_two_feedback_rows(tmp_path):
    sizes = preference_study.split_data(tmp_path)
    data = tmp_path / "data"
    val_pairs, train_pairs = ids(data / "pairs_val.jsonl"), ids(data / "pairs_train.jsonl")
    assert len(val_pairs) * 4 == len(train_pairs) == sizes["pairs"] and not set(val_pairs) & set(train_pairs)
    val_rows = ids(data / "feedback_val.jsonl")
    assert sorted(val_rows) == sorted(f"{pair}-{kind}" for pair in val_pairs for kind in ("chosen", "rejected"))
    assert sizes["feedback"] == 2 * sizes["pairs"]
    assert not {row.rsplit("-", 1)[0] for row in ids(data / "feedback_train.jsonl")} & set(val_pairs)


def test_equal_time_gives_the_faster_method_full_backprops_training_time():
    reference = {"steps": 18, "median_step_time_s": 3.0}
    assert preference_study.equal_time_steps(reference, {"steps": 18, "median_step_time_s": 2.0}) == 27
    # a slower method keeps its equal-epochs steps
    assert preference_study.equal_time_steps(reference, {"steps": 18, "median_step_time_s": 4.0}) == 18
