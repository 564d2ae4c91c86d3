"""Bad input everywhere: exit code 2, one clear `error:` line on stderr naming the file/key/line and the fix, no
traceback, and a refused command creates, changes or deletes nothing (in a finished run dir or anywhere else).

Every case runs the CLI in the test process (helpers.cli); a case per verb also runs as a real `python -m lcsb_cli`
subprocess and must print the same line, so nothing a fresh interpreter prints at import slips by. Both run with a
stand-in third-party library (tests/noisy_library.py) that logs and warns at import and while the model loads:
lcsb's stderr holds its own line only. One finished run (the "fixture run") is built once per
module; the cases that target it must leave it byte-identical. Cases that point at bad files read them from a
shared, prepared directory, which must stay unchanged too; a case's new output paths live in its own tmp dir,
which must stay empty.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import LAMP2, REPO, assert_one_line_error, cli, lcsb, run_train, snapshot
from noisy_library import MARK, import_library, noisy_from_pretrained

DATA = REPO / "recipes" / "data" / "lamp2"
# in this process pytest records them; fresh ones show
pytestmark = pytest.mark.filterwarnings(f"ignore:{MARK}")


# --- the world the cases run in ------------------------------------------------------------------


def _write_bad_files(bad: Path, run: Path) -> None:
    """Every broken input a case points at, made once."""
    bad.mkdir()
    lamp2 = LAMP2.read_text()
    # recipes
    # bad indent on line 4
    (bad / "broken.yaml").write_text("name: broken\ntrain:\n  max_steps: 3\n lr: 0.1\n")
    (bad / "list.yaml").write_text("- name: a-list\n- method: lcsb\n")
    (bad / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01name: \x80\x81\n")
    assert "\nmethod: lcsb" in lamp2 and "  max_steps: 60\n" in lamp2
    (bad / "topkey.yaml").write_text(lamp2.replace("\nmethod: lcsb", "\nmethd: lcsb"))
    (bad / "nested.yaml").write_text(lamp2.replace("  max_steps: 60\n", "  max_stesp: 60\n"))
    # data
    text = (DATA / "train_questions.json").read_text()
    (bad / "truncated_questions.json").write_text(text[: len(text) // 2])
    outputs = json.loads((DATA / "train_outputs.json").read_text())
    dropped = dict(outputs, golds=outputs["golds"][1:])
    (bad / "missing_gold_outputs.json").write_text(json.dumps(dropped, indent=1))
    badtag = json.loads(json.dumps(outputs))
    badtag["golds"][3]["output"] = "horror"
    (bad / "badtag_outputs.json").write_text(json.dumps(badtag, indent=1))
    # models
    (bad / "empty_model").mkdir()
    (bad / "t5_model").mkdir()
    (bad / "t5_model" / "config.json").write_text('{"model_type": "t5"}\n')
    (bad / "badjson_model").mkdir()
    (bad / "badjson_model" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": \n')
    # made by the fixture run
    preset = next(Path(os.environ["LCSB_CACHE"], "presets").glob("tiny-qwen2-*"))
    (bad / "noweights_model").mkdir()
    shutil.copy(preset / "config.json", bad / "noweights_model" / "config.json")
    (bad / "notokenizer_model").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(preset / name, bad / "notokenizer_model" / name)
    # dirs that are not (finished) runs
    (bad / "empty_adapter").mkdir()
    (bad / "empty_adapter" / "adapter_model.safetensors").write_bytes(
        (run / "adapter" / "adapter_model.safetensors").read_bytes()
    )
    (bad / "notrun").mkdir()
    (bad / "notrun" / "notes.txt").write_text("just some dir\n")
    (bad / "nonempty").mkdir()
    (bad / "nonempty" / "keep.txt").write_text("do not overwrite\n")
    (bad / "a_file").write_text("a plain file, not a directory\n")
    # a run killed before its first checkpoint
    (bad / "killed_early").mkdir()
    shutil.copy(run / "config.yaml", bad / "killed_early" / "config.yaml")
    (bad / "killed_early" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    # config.yaml and checkpoints, no adapter/ yet
    (bad / "noadapter_run").mkdir()
    shutil.copy(run / "config.yaml", bad / "noadapter_run" / "config.yaml")
    shutil.copytree(run / "checkpoints", bad / "noadapter_run" / "checkpoints")


@pytest.fixture
def noisy(monkeypatch):
    """The stand-in library for an in-process command: patched into model loading; returns its import."""
    import transformers

    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", noisy_from_pretrained(transformers.AutoConfig.from_pretrained)
    )
    return import_library


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    run = root / "run"
    run_train(run, "train.max_steps=2", "train.save_every=1")
    assert (run / "summary.json").is_file() and (run / "adapter" / "adapter_config.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    _write_bad_files(root / "bad", run)
    return root


def _missing_gold_id() -> str:
    return str(json.loads((DATA / "train_outputs.json").read_text())["golds"][0]["id"])


def _truncated_json_line() -> str:
    text = (DATA / "train_questions.json").read_text()
    try:
        json.loads(text[: len(text) // 2])
    except json.JSONDecodeError as exc:
        return f"line {exc.lineno}, column {exc.colno}"
    raise AssertionError("half of the questions file parsed")


V, T, E, X = "validate", "train", "eval", "export"
# the recipe helpers.run_train uses, as a user in the repo root types it
R = str(LAMP2.relative_to(REPO))


# (id, args with {run} {bad} {new} placeholders, key words the single error line must hold[, marks])
CASES = [
    # --- recipe files (validate: no model load, fast)
    ("missing-recipe", [V, "{bad}/no-such-recipe.yaml"], ["no-such-recipe.yaml", "not found"]),
    ("yaml-syntax", [V, "{bad}/broken.yaml"], ["broken.yaml", "not valid yaml", "line 4"]),
    ("yaml-list", [V, "{bad}/list.yaml"], ["list.yaml", "mapping"]),
    ("yaml-not-utf8", [V, "{bad}/binary.yaml"], ["binary.yaml", "utf-8"]),
    ("unknown-top-key", [V, "{bad}/topkey.yaml"], ["topkey.yaml", "methd", "did you mean method?"]),
    ("misspelt-nested-key", [V, "{bad}/nested.yaml"], ["train.max_stesp", "did you mean train.max_steps?"]),
    ("misspelt-override", [V, R, "lcsb.blcks=2"], ["lcsb.blcks", "did you mean lcsb.blocks?"]),
    # --- values
    ("wrong-type", [V, R, "train.max_steps=abc"], ["train.max_steps", "integer", "abc"]),
    ("not-a-list", [V, R, "lora.targets={a: 1}"], ["lora.targets", "list"]),
    ("k-below-1", [V, R, "lcsb.blocks=0"], ["lcsb.blocks", "minimum 1"]),
    ("negative-steps", [V, R, "train.max_steps=-5"], ["train.max_steps", "-5", "minimum 1"]),
    ("lr-nan", [V, R, "train.lr=nan"], ["train.lr", "finite"]),
    ("lr-zero", [V, R, "train.lr=0"], ["train.lr", "positive"]),
    ("unknown-backend", [V, R, "backend=tpu"], ["backend", "tpu", "cpu"]),
    ("npu-sim-with-bnb", [V, R, "backend=npu-sim", "quantization=nf4"], ["quantization", "npu_sim.weights"]),
    ("npu-sim-weights", [V, R, "backend=npu-sim", "npu_sim.weights=int2"], ["npu_sim.weights", "int2", "int4"]),
    (
        "npu-sim-device",
        [T, R, "backend=npu-sim", "npu_sim.device=pixel-99", "--output", "{new}/r"],
        ["npu_sim.device", "pixel-99", "snapdragon-8gen3"],
    ),
    ("overnight-window", [V, R, "overnight.window=25:00-06:00"], ["overnight.window", "HH:MM-HH:MM"]),
    ("jsonl-all-users", [V, R, "data.format=jsonl", "data.user=all"], ["data.user", "jsonl"]),
    ("jsonl-fraction", [V, R, "data.format=jsonl", "data.eval_fraction=1.5"], ["data.eval_fraction", "1.5"]),
    ("nproc-mezo", [T, R, "method=mezo", "--nproc", "2", "--output", "{new}/r"], ["mezo", "one process"]),
    ("unknown-method", [V, R, "method=sgd"], ["method", "sgd", "lcsb"]),
    ("unknown-quantization", [V, R, "quantization=int3"], ["quantization", "int3", "nf4"]),
    ("unknown-dtype", [V, R, "model.dtype=float16"], ["model.dtype", "float16", "bfloat16"]),
    ("max-length-2", [V, R, "data.max_length=2"], ["data.max_length", "minimum 16"]),
    ("lora-alpha-zero", [V, R, "lora.alpha=0"], ["lora.alpha"]),
    ("no-train-data", [V, R, "data.train=null"], ["data.train"]),
    # --- overrides
    ("override-without-equals", [V, R, "train.max_steps"], ["train.max_steps", "key=value"]),
    ("override-empty-key", [V, R, "=5"], ["key=value"]),
    ("override-into-a-value", [V, R, "train.max_steps.x=3"], ["max_steps", "not a section"]),
    # --- flags (click's usage errors are bad input too, as README's exit codes say)
    ("unknown-flag", [T, R, "--bogus"], ["--bogus"]),
    ("missing-required-option", [X, "{run}"], ["--output"]),
    # --- the model (train: fails after set-up starts, before anything is written)
    ("k-above-layers", [T, R, "lcsb.blocks=99", "--output", "{new}"], ["lcsb.blocks", "99", "layers"]),
    (
        "model-dir-missing",
        [T, R, "model.name={bad}/no-such-model", "--output", "{new}"],
        ["model.name", "no-such-model", "preset"],
    ),
    (
        "model-dir-without-config",
        [T, R, "model.name={bad}/empty_model", "--output", "{new}"],
        ["model.name", "empty_model", "config.json"],
    ),
    (
        "model-not-causal-lm",
        [T, R, "model.name={bad}/t5_model", "--output", "{new}"],
        ["model.name", "t5", "not a causal language model"],
    ),
    (
        "model-without-weights",
        [T, R, "model.name={bad}/noweights_model", "--output", "{new}"],
        ["model.name", "noweights_model", "weights"],
    ),
    (
        "model-without-tokenizer",
        [T, R, "model.name={bad}/notokenizer_model", "train.max_steps=1", "--output", "{new}"],
        ["model.name", "notokenizer_model", "tokenizer"],
    ),
    (
        "lora-target-missing",
        [T, R, "lora.targets=[q_proj, wqkv]", "--output", "{new}"],
        ["lora.targets", "wqkv", "q_proj"],
    ),
    # --- data
    (
        "train-file-missing",
        [T, R, "data.train={bad}/no-such-questions.json", "--output", "{new}"],
        ["data.train", "no-such-questions.json", "does not exist"],
    ),
    (
        "questions-truncated",
        [T, R, "data.train={bad}/truncated_questions.json", "--output", "{new}"],
        ["truncated_questions.json", "invalid json", _truncated_json_line()],
    ),
    (
        "gold-missing",
        [T, R, "data.train_labels={bad}/missing_gold_outputs.json", "--output", "{new}"],
        ["missing_gold_outputs.json", "no gold", repr(_missing_gold_id())],
    ),
    (
        "gold-outside-tags",
        [T, R, "data.train_labels={bad}/badtag_outputs.json", "--output", "{new}"],
        ["badtag_outputs.json", "'horror'", "15 lamp-2 tags"],
    ),
    (
        "max-length-too-small-for-question",
        [T, R, "data.max_length=16", "--output", "{new}"],
        ["max_length=16", "data.max_length to at least"],
    ),
    ("train-output-is-a-file", [T, R, "train.max_steps=1", "--output", "{bad}/a_file"], ["a_file"]),
    # --- an existing run dir
    (
        "train-over-existing-run",
        [T, R, "train.max_steps=2", "--output", "{run}"],
        ["already holds a run", "--resume", "--force"],
    ),
    ("train-force-bad-k-keeps-run", [T, R, "lcsb.blocks=99", "--force", "--output", "{run}"], ["lcsb.blocks", "99"]),
    (
        "resume-without-checkpoints",
        [T, R, "--resume", "--output", "{bad}/killed_early"],
        ["killed_early", "no checkpoint", "without --resume"],
    ),
    (
        "resume-changed-lr",
        [T, R, "train.max_steps=2", "train.save_every=1", "train.lr=5e-4", "--resume", "--output", "{run}"],
        ["--resume", "train.lr", "config.yaml"],
    ),
    ("eval-not-a-run", [E, "{bad}/notrun"], ["notrun", "not a run directory"]),
    (
        "eval-adapter-without-config",
        [E, "{run}", "--adapter", "{bad}/empty_adapter"],
        ["--adapter", "empty_adapter", "adapter_config.json"],
    ),
    ("eval-run-without-adapter", [E, "{bad}/noadapter_run"], ["noadapter_run", "no adapter"]),
    ("eval-run-bad-override", [E, "{run}", "lcsb.blocks=0"], ["lcsb.blocks", "minimum 1"]),
    (
        "eval-run-eval-file-missing",
        [E, "{run}", "data.eval={bad}/no-such-dev.json"],
        ["data.eval", "no-such-dev.json", "does not exist"],
    ),
    # --- export
    ("export-output-not-empty", [X, "{run}", "--output", "{bad}/nonempty"], ["--output", "nonempty", "not empty"]),
    ("export-output-is-the-run", [X, "{run}", "--output", "{run}"], ["--output", "not empty"]),
    ("export-not-a-run", [X, "{bad}/notrun", "--output", "{new}"], ["notrun", "not a run directory"]),
    ("export-run-without-adapter", [X, "{bad}/noadapter_run", "--output", "{new}"], ["noadapter_run", "no adapter"]),
    ("export-unknown-user", [X, "{run}", "--user", "nobody", "--output", "{new}"], ["nobody", "no adapter"]),
]


PARAMS = [pytest.param(args, needles, id=name, marks=marks) for name, args, needles, *marks in CASES]


def fill(arg: str, places: dict[str, Path]) -> str:
    for key, value in places.items():
        arg = arg.replace("{" + key + "}", str(value))
    return arg


@pytest.mark.parametrize("args,needles", PARAMS)
def test_bad_input_exits_2_with_one_line_and_touches_nothing(world, tmp_path, noisy, args, needles):
    places = {"run": world / "run", "bad": world / "bad", "new": tmp_path / "new"}
    argv = [fill(a, places) for a in args]
    before = snapshot(world)

    proc = cli(*argv, setup=noisy)

    assert_one_line_error(proc, *needles)
    after = snapshot(world)
    assert sorted(after) == sorted(before), "the refused command added or removed files"
    assert after == before, "the refused command changed files"
    assert not any(tmp_path.iterdir()), f"the refused command created {sorted(tmp_path.iterdir())}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["misspelt-nested-key", "model-not-causal-lm", "eval-run-eval-file-missing", "export-run-without-adapter"]
)
def test_a_fresh_process_prints_the_same_one_line(world, tmp_path, noisy, case):
    args = next(args for name, args, *_ in CASES if name == case)
    argv = [fill(a, {"run": world / "run", "bad": world / "bad", "new": tmp_path / "new"}) for a in args]
    fresh, here = lcsb(*argv, noisy=True), cli(*argv, setup=noisy)
    assert (
        (fresh.returncode, fresh.stderr, fresh.stdout)
        == (here.returncode, here.stderr, here.stdout)
        == (2, here.stderr, "")
    ), fresh.stderr
    assert len(fresh.stderr.splitlines()) == 1


@pytest.mark.slow
def test_verbose_shows_the_libraries_lines_too(world, tmp_path):
    """The same bad input with -v: the stand-in library's records and warnings on stderr, then the error line."""
    argv = [
        "-v",
        *[
            fill(a, {"bad": world / "bad", "new": tmp_path / "new"})
            for a in next(args for name, args, *_ in CASES if name == "model-not-causal-lm")
        ],
    ]
    proc = lcsb(*argv, noisy=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert sum(MARK in line for line in lines) == 5, proc.stderr
    assert lines[-1].startswith("error:") and "not a causal language model" in lines[-1]


def test_there_are_enough_cases():
    assert len(CASES) >= 25
    assert {case[1][0] for case in CASES} >= {V, T, E, X}


def test_debug_prints_the_traceback_of_a_bad_input(world):
    """The same bad input, with --debug: the traceback, then the one error line."""
    before = snapshot(world)
    proc = lcsb("--debug", "validate", str(world / "bad" / "nested.yaml"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and "BadInput" in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error:") and "train.max_stesp" in last, proc.stderr
    assert snapshot(world) == before
