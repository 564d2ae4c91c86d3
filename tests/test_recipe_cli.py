"""Recipes (typing, paths, overrides, errors), the CLI contract (exit codes, stderr) and run-dir safety."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_one_line_error, cli, lcsb, snapshot

from lcsb_cli import recipe as rc
from lcsb_cli import rundir
from lcsb_cli.errors import BadInput
from lcsb_cli.rundir.checkpoint import checkpoint_dirs

LAMP2 = REPO / "recipes" / "lamp2.yaml"


def write_recipe(path: Path, replace: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of lamp2.yaml with lines replaced or dropped, keyed by their start (indent included)."""
    lines = []
    for line in LAMP2.read_text().splitlines():
        key = line.split(":")[0] + ":"
        if key not in drop:
            lines.append((replace or {}).get(key, line))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def bad(overrides=(), path=LAMP2) -> str:
    with pytest.raises(BadInput) as info:
        rc.load_recipe(path, list(overrides))
    return str(info.value)


# --- loading -------------------------------------------------------------------------------------


def test_lamp2_loads_typed_with_paths_absolute_relative_to_the_file(tmp_path, monkeypatch):
    # nowhere near the recipe: paths must not depend on the cwd
    monkeypatch.chdir(tmp_path)
    r = rc.load_recipe(LAMP2)

    # values the file sets away from the defaults: each one shows its section was read, not defaulted
    def values(recipe):
        return (
            recipe.name,
            recipe.model.name,
            recipe.data.user,
            recipe.freeze.layers,
            recipe.lisa.interval,
            recipe.train.warmup_steps,
            recipe.train.max_steps,
            recipe.train.lr,
        )

    assert values(r) == ("lamp2-tiny", "lamp-tiny", "all", 2, 10, 3, 30, 1e-3)
    assert all(a != b for a, b in zip(values(r), values(rc.Recipe())))
    assert type(r.train.lr) is float and type(r.train.max_steps) is int
    alpha = rc.load_recipe(write_recipe(tmp_path / "alpha.yaml", {"  alpha:": "  alpha: 8"})).lora.alpha
    # an integer written for a float field
    assert type(alpha) is float and alpha == 8.0
    # recipes/ links to the package data
    data = (REPO / "recipes" / "data" / "lamp2").resolve()
    assert r.data.train == str(data / "train_questions.json") and Path(r.data.train).is_file()
    for p in (r.data.train, r.data.train_labels, r.data.eval, r.data.eval_labels):
        assert Path(p).is_absolute() and Path(p).is_file()


@pytest.mark.parametrize("text,value", [("1e-4", 1e-4), ("1.0e-3", 1e-3), ("5e-5", 5e-5), ("0.01", 0.01)])
def test_lr_in_scientific_notation_is_a_float(tmp_path, monkeypatch, text, value):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "sub" / "r.yaml", {"  lr:": f"  lr: {text}", "  max_steps:": "  max_steps: 3"})
    r = rc.load_recipe(path)
    assert type(r.train.lr) is float and r.train.lr == pytest.approx(value)
    assert r.train.max_steps == 3
    # paths are relative to the copied recipe's own dir, not the cwd or the repo
    assert r.data.train == str((tmp_path / "sub" / "data" / "lamp2" / "train_questions.json").resolve())


def test_output_dir_defaults_to_runs_name(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", {"name:": "name: my-run"}, drop=("output_dir:",))
    assert rc.load_recipe(path).output_dir == "runs/my-run"
    assert rc.load_recipe(LAMP2).output_dir == "runs/lamp2-tiny"


# --- overrides -----------------------------------------------------------------------------------


def test_dotted_overrides_apply_with_types():
    r = rc.load_recipe(
        LAMP2,
        [
            "train.max_steps=20",
            "lcsb.blocks=2",
            "backend=npu-sim",
            "lora.targets=[q_proj,v_proj]",
            "train.lr=2e-4",
            "activation_checkpointing=true",
        ],
    )
    assert r.train.max_steps == 20 and type(r.train.max_steps) is int
    assert r.lcsb.blocks == 2 and r.backend == "npu-sim"
    assert r.lora.targets == ["q_proj", "v_proj"]
    assert type(r.train.lr) is float and r.train.lr == pytest.approx(2e-4)
    assert r.activation_checkpointing is True
    assert rc.load_recipe(LAMP2, ["lora.targets=q_proj,v_proj"]).lora.targets == ["q_proj", "v_proj"]
    # nothing leaks between loads
    assert rc.load_recipe(LAMP2).train.max_steps == 30


def test_override_paths_resolve_against_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = rc.load_recipe(LAMP2, ["data.train=mine/q.json", "data.eval=2024"])
    assert r.data.train == str(tmp_path.resolve() / "mine" / "q.json")
    # a name YAML reads as a number is still a path
    assert r.data.eval == str(tmp_path.resolve() / "2024")
    assert r.data.train_labels == str((REPO / "recipes" / "data" / "lamp2" / "train_outputs.json").resolve())


@pytest.mark.parametrize("item", ["data.eval=null", "data.eval="])
def test_override_can_clear_an_optional_path(tmp_path, monkeypatch, item):
    monkeypatch.chdir(tmp_path)
    assert rc.load_recipe(LAMP2, ["data.user=null", item]).data.eval is None


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["trian.max_steps=3"], ["trian", "did you mean train"]),
        (["lcsb.blcks=2"], ["lcsb.blcks", "did you mean lcsb.blocks"]),
        (["train.max_steps=abc"], ["train.max_steps", "integer", "abc"]),
        (["train.max_steps=2.5"], ["train.max_steps", "integer"]),
        (["lcsb.blocks=0"], ["lcsb.blocks", "minimum 1"]),
        (["train.max_steps=-1"], ["train.max_steps", "minimum"]),
        (["train.lr=0"], ["train.lr"]),
        (["train.lr=nan"], ["train.lr", "finite"]),
        (["lora.dropout=.inf"], ["lora.dropout", "finite"]),
        (["method=foo"], ["method", "foo", "lcsb"]),
        (["quantization=int3"], ["quantization", "int3", "nf4"]),
        (["backend=tpu"], ["backend", "tpu", "cpu"]),
        (["lora.targets=[]"], ["lora.targets"]),
        (["train.max_steps"], ["train.max_steps", "KEY=VALUE"]),
        (["=3"], ["KEY=VALUE"]),
    ],
)
def test_bad_values_name_the_key(overrides, needles):
    message = bad(overrides)
    for needle in needles:
        assert needle in message, message


def test_bad_files(tmp_path):
    assert "not found" in bad(path=tmp_path / "nope.yaml") and "nope.yaml" in bad(path=tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\ntrain:\n  max_steps: 3\n  lr: [1e-4\nmethod: lcsb\n")
    message = bad(path=broken)
    assert "not valid YAML" in message and "line 5" in message, message
    listed = tmp_path / "list.yaml"
    listed.write_text("- name: x\n- method: lcsb\n")
    assert "mapping" in bad(path=listed)
    unknown = write_recipe(tmp_path / "unknown.yaml", {"method:": "methd: lcsb"})
    assert "unknown key methd; did you mean method" in bad(path=unknown)


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_help_recipes_validate():
    result = cli("--help")
    assert result.returncode == 0 and all(v in result.stdout for v in ("train", "validate", "recipes"))
    result = cli("recipes")
    assert result.returncode == 0 and "lamp2" in result.stdout
    result = cli("validate", "recipes/lamp2.yaml", "train.max_steps=7")
    assert result.returncode == 0, result.stderr
    assert "max_steps: 7" in result.stdout
    # the output is the resolved recipe, as YAML
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["max_steps"] == 7 and resolved["output_dir"] == "runs/lamp2-tiny"
    # a shipped recipe by name
    assert cli("validate", "lamp2").returncode == 0


@pytest.mark.parametrize(
    "args,key",
    [
        (["validate", "recipes/lamp2.yaml", "lcsb.blcks=2"], "lcsb.blcks"),
        (["validate", "recipes/lamp2.yaml", "quantization=int3"], "quantization"),
        (["validate", "recipes/missing.yaml"], "missing.yaml"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, key):
    assert key in assert_one_line_error(cli(*args))


def test_cli_debug_shows_traceback():
    result = cli("--debug", "validate", "recipes/lamp2.yaml", "lcsb.blocks=0")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "BadInput" in result.stderr


def test_subprocess_validate_ok():
    proc = lcsb("validate", "recipes/lamp2.yaml", "train.max_steps=7")
    assert proc.returncode == 0 and "max_steps: 7" in proc.stdout and proc.stderr == ""


def test_subprocess_bad_input_stderr_exact():
    proc = lcsb("validate", "recipes/lamp2.yaml", "lcsb.blcks=2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: command line: override 'lcsb.blcks=2': unknown key lcsb.blcks; did you mean lcsb.blocks?\n"
        # the typo is on the command line, not in the file
    )
    proc = lcsb("validate", "recipes/lamp2.yaml", "backend=tpu")
    assert proc.returncode == 2
    assert proc.stderr == "error: backend: 'tpu' is not one of cpu, cuda, npu-sim, npu-htp\n"


@pytest.mark.slow
def test_version_and_short_help_with_examples_and_flags_shown_as_flags():
    from importlib.metadata import version

    proc = lcsb("--version")
    assert (proc.returncode, proc.stdout) == (0, f"lcsb {version('lcsb')}\n")
    for verb in ("train", "eval", "generate", "chat", "validate", "bench", "export", "recipes"):
        proc = lcsb(verb, "-h")
        assert proc.returncode == 0 and "Example" in proc.stdout, verb
        assert verb in ("validate", "export", "recipes") or "lcsb validate RECIPE" in " ".join(proc.stdout.split())
        flags = [
            line
            for line in proc.stdout.splitlines()
            if any(f"--{name}" in line for name in ("resume", "force", "chat", "merge", "eval"))
        ]
        assert not any("<bool>" in line for line in flags), flags


def test_a_hub_id_is_refused_at_validate_with_how_to_fetch_it(tmp_path):
    hub = (
        "error: model.name: 'Qwen/Qwen2.5-0.5B' is no local path, and lcsb downloads nothing; fetch it yourself "
        "with `hf download Qwen/Qwen2.5-0.5B --local-dir DIR`, then set model.name=DIR\n"
    )
    proc = lcsb("validate", "recipes/lamp2.yaml", "model.name=Qwen/Qwen2.5-0.5B")
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", hub)
    recipe = tmp_path / "hub.yaml"
    recipe.write_text((REPO / "recipes" / "lamp2.yaml").read_text() + "\nmodel: {name: Qwen/Qwen2.5-0.5B}\n")
    proc = lcsb("validate", str(recipe))
    assert (proc.returncode, proc.stderr) == (2, hub)
    # a local dir of that name is a path, as typed
    (tmp_path / "Qwen" / "Qwen2.5-0.5B").mkdir(parents=True)
    assert (
        lcsb("validate", str(REPO / "recipes" / "lamp2.yaml"), "model.name=Qwen/Qwen2.5-0.5B", cwd=tmp_path).returncode
        == 0
    )


# --- run dir safety ------------------------------------------------------------------------------


def fake_run(run: Path) -> Path:
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(rc.dump(rc.load_recipe(LAMP2)))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.1}\n')
    return run


def test_train_refuses_an_existing_run_without_force(tmp_path):
    run = fake_run(tmp_path / "run")
    before = snapshot(run)
    result = cli("train", "recipes/lamp2.yaml", "--output", str(run), "train.max_steps=1")
    assert result.returncode == 2, result.stderr
    assert "--force" in result.stderr and "--resume" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert snapshot(run) == before


def test_resume_without_checkpoints_exits_2_and_leaves_the_dir(tmp_path):
    run = fake_run(tmp_path / "run")
    before = snapshot(run)
    result = cli("train", "recipes/lamp2.yaml", "--output", str(run), "--resume", "train.max_steps=1")
    assert result.returncode == 2 and "checkpoint" in result.stderr, result.stderr
    assert snapshot(run) == before


def test_truncate_metrics_keeps_complete_rows_up_to_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    assert rundir.truncate_metrics(path, 3) == rows[:3]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    # killed mid-write
    path.write_text(json.dumps(rows[0]) + "\n" + '{"step": 2, "loss": 2.')
    assert rundir.truncate_metrics(path, 4) == rows[:1]
    assert path.read_text() == json.dumps(rows[0]) + "\n"


def test_check_resume_allows_only_harmless_changes(tmp_path):
    run = tmp_path / "run"
    original = rc.load_recipe(LAMP2, ["data.user=null", f"output_dir={run}"])
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-10").mkdir()
    (run / "checkpoints" / "step-2" / "manifest.json").write_text('{"step": 2, "files": {}}')
    (run / "checkpoints" / "step-10" / "manifest.json").write_text('{"step": 10, "files": {}}')
    (run / "config.yaml").write_text(rc.dump(original))
    before = snapshot(run)
    with pytest.raises(BadInput, match="train.lr"):
        rundir.check_resume(run, rc.load_recipe(LAMP2, ["data.user=null", f"output_dir={run}", "train.lr=5e-4"]))
    # a refused resume rewrites nothing
    assert snapshot(run) == before
    longer = rc.load_recipe(LAMP2, ["data.user=null", f"output_dir={run}", "train.max_steps=100"])
    rundir.check_resume(run, longer)
    # checking writes nothing; claim() does, once set-up has passed
    assert snapshot(run) == before
    # newest, numerically
    assert checkpoint_dirs(run / "checkpoints")[0] == run / "checkpoints" / "step-10"
    rundir.claim(run, longer, resume=True, resumed_step=0)
    assert rc.recipe_from_dict(yaml.safe_load((run / "config.yaml").read_text())) == longer
