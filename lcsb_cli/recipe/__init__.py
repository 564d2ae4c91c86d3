"""Recipes: YAML -> typed dataclasses, dotted KEY=VALUE overrides, validation with clear errors."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import yaml

from ..errors import BadInput
from ..host import choose_autocast, native_bf16_flag
from ..window import parse_window
from .parse import apply_override, build, choices_of, fields_of, resolve_paths
from .schema import ALL_LINEAR, COLUMN_ROLES, MOVED_KEYS, DataConfig, Recipe

DATA_FILES = {
    "jsonl": "phone-collected labels, one JSON object a line",
    "text": '.txt, or {"text"} records in JSONL, JSON, parquet, CSV, arrow or a save_to_disk directory',
    "completion": '{"prompt", "completion"} records in JSONL, JSON, parquet, CSV, arrow or a save_to_disk directory',
    "chat": '{"messages"} records in JSONL, JSON, parquet, CSV, arrow or a save_to_disk directory',
    "preference": '{"prompt", "chosen", "rejected"} records in JSONL, JSON, parquet, CSV, arrow or save_to_disk',
    "feedback": '{"prompt", "completion", "label"} records in JSONL, JSON, parquet, CSV, arrow or save_to_disk',
}
# the data format each objective learns from (objectives/)
OBJECTIVE_FORMATS = {"dpo": ("preference",), "orpo": ("preference",), "kto": ("feedback",)}


# train.report_to: each tracker and the modules its extra installs (mlflow's SQLite store needs sqlalchemy, alembic)
TRACKER_MODULES = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "trackio": ("trackio",),
}

CHOICES = {dotted: choices_of(hint) for dotted, _, hint in fields_of(Recipe) if choices_of(hint)}
MINIMUMS = {dotted: f.metadata["min"] for dotted, f, _ in fields_of(Recipe) if f.metadata.get("min") is not None}


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply KEY=VALUE overrides and validate everything but model-dependent ranges.

    Paths written in the file are relative to the file; paths given as overrides are relative to the cwd.
    """
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: recipe file not found (see `lcsb recipes` for the shipped ones)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (UnicodeDecodeError, OSError) as exc:
        raise BadInput(
            f"{path}: cannot be read as UTF-8 text ({exc.__class__.__name__}); save it as UTF-8 YAML"
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BadInput(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: a recipe is a YAML mapping of keys (name, model, method, ...)")
    resolve_paths(raw, path.parent)
    for item in overrides:
        apply_override(raw, item, Recipe)
    recipe = build(Recipe, raw, "", source=str(path))
    recipe.output_dir = recipe.output_dir or f"runs/{recipe.name}"
    validate(recipe)
    return recipe


def recipe_from_dict(raw: dict, source: str = "config.yaml") -> Recipe:
    recipe = build(Recipe, _with_moved_keys_in_place(raw), "", source=source)
    validate(recipe)
    return recipe


def _with_moved_keys_in_place(raw: dict) -> dict:
    """A run directory's config.yaml written before the experimental dials moved (MOVED_KEYS) reads as it did."""
    lcsb = raw.get("lcsb")
    if not isinstance(lcsb, dict):
        return raw
    moved = {name: lcsb[name] for name in lcsb if f"lcsb.{name}" in MOVED_KEYS}
    if not moved:
        return raw
    kept = {name: value for name, value in lcsb.items() if name not in moved}
    return {**raw, "lcsb": {**kept, "experimental": {**moved, **(lcsb.get("experimental") or {})}}}


def with_overrides(recipe: Recipe, overrides: typing.Sequence[str], source: str) -> Recipe:
    """A copy of `recipe` with dotted KEY=VALUE overrides applied and validated."""
    raw = to_dict(recipe)
    for item in overrides:
        apply_override(raw, item, Recipe)
    return recipe_from_dict(raw, source)


to_dict = dataclasses.asdict


def dump(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)


def validate(recipe: Recipe) -> None:
    for key, allowed in CHOICES.items():
        value = get_key(recipe, key)
        if value not in allowed:
            raise BadInput(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    for key, minimum in MINIMUMS.items():
        value = get_key(recipe, key)
        if value < minimum:
            raise BadInput(f"{key}: {value} is below the minimum {minimum}")
    if not 0 < recipe.divergence.lr_backoff <= 1:
        raise BadInput(f"divergence.lr_backoff: {recipe.divergence.lr_backoff} must be in (0, 1]")
    if recipe.divergence.snapshot == "none" and recipe.divergence.action != "stop":
        raise BadInput(
            f"divergence.snapshot: none keeps no state to {recipe.divergence.action} to; set "
            "divergence.action=stop (the last checkpoint is the state to resume from) or snapshot=disk"
        )
    if recipe.lora.dropout >= 1:
        raise BadInput(f"lora.dropout: {recipe.lora.dropout} must be below 1")
    if recipe.lora.backward == "mesp" and recipe.lora.dropout:
        raise BadInput(
            f"lora.backward: mesp recomputes xA from x and keeps no dropout mask; set lora.dropout=0 "
            f"(not {recipe.lora.dropout}) or lora.backward=autograd"
        )
    for key in ("lora.alpha", "mezo.eps", "mezo.lr", "train.lr"):
        if get_key(recipe, key) <= 0:
            raise BadInput(f"{key}: {get_key(recipe, key)} must be positive")
    _validate_npu(recipe)
    _validate_memory(recipe)
    _validate_trackers(recipe.train.report_to)
    _validate_best(recipe.train)
    if not recipe.lora.targets:
        raise BadInput("lora.targets: name at least one module, e.g. [q_proj, v_proj]")
    if ALL_LINEAR in recipe.lora.targets and len(recipe.lora.targets) > 1:
        raise BadInput(f"lora.targets: {ALL_LINEAR} already names every linear layer; give it alone or list names")
    if recipe.data.format in DATA_FILES:
        _validate_data_file(recipe.data)
    elif recipe.data.train is None and recipe.data.user is None:
        raise BadInput("data.train: no training file given (a LaMP-2 *_questions.json)")
    elif recipe.data.user is not None and recipe.data.eval is None:
        raise BadInput("data.eval: per-user runs (data.user) need the users' questions file")
    _validate_format_keys(recipe.data)
    _validate_objective(recipe)
    if recipe.data.columns:
        _validate_columns(recipe.data)
    if recipe.overnight.window is not None:
        parse_window(recipe.overnight.window)


def _validate_npu(recipe: Recipe) -> None:
    import importlib.util

    npu = recipe.npu_sim
    if recipe.backend in ("npu-sim", "npu-htp") and (
        recipe.quantization not in ("none", "gguf") or recipe.train.autocast == "bf16"
    ):
        raise BadInput(
            f"quantization, train.autocast: {recipe.backend} keeps its own resident weights and product "
            "precision (npu_sim.weights, npu_sim.precision); set quantization=none (or gguf) and "
            "train.autocast=none (or auto)"
        )
    if npu.precision in ("w8a16", "w8a8") and npu.weights != "int8":
        raise BadInput(f"npu_sim.precision: {npu.precision} products read int8 weights; set npu_sim.weights=int8")
    if recipe.backend != "npu-htp":
        return
    if npu.weights != "int8":
        raise BadInput(
            f"npu_sim.weights: npu-htp holds int8 weights on HTP, not {npu.weights}; set npu_sim.weights=int8"
        )
    if importlib.util.find_spec("onnxruntime_qnn") is None or importlib.util.find_spec("onnx") is None:
        raise BadInput("backend: npu-htp needs onnxruntime-qnn and onnx: pip install -e '.[npu]'")


def _validate_memory(recipe: Recipe) -> None:
    if recipe.memory.streamed_load and recipe.quantization not in ("nf4", "fp4"):
        raise BadInput(
            f"memory.streamed_load: builds 4-bit models; set quantization=nf4 (or fp4), not {recipe.quantization}"
        )
    if recipe.memory.streamed_load and recipe.backend != "cpu":
        raise BadInput("memory.streamed_load: the streamed 4-bit build runs on backend=cpu")
    if recipe.memory.streamed_load and recipe.model.trust_remote_code:
        raise BadInput(
            "memory.streamed_load: builds transformers' own architectures; a model that needs "
            "model.trust_remote_code loads with memory.streamed_load=false"
        )
    if recipe.memory.embedding != "keep" and not (recipe.memory.streamed_load or recipe.quantization == "gguf"):
        raise BadInput(
            "memory.embedding: a 4-bit embedding / LM head needs memory.streamed_load=true (or quantization=gguf)"
        )


def _validate_trackers(trackers: list[str]) -> None:
    """Each tracker named once, known, and installed (its extra: `pip install 'lcsb[NAME]'`)."""
    import importlib.util

    for tracker in trackers:
        if tracker not in TRACKER_MODULES:
            raise BadInput(
                f"train.report_to: {tracker!r} is not a known tracker; choose from {', '.join(TRACKER_MODULES)}"
            )
        if trackers.count(tracker) > 1:
            raise BadInput(f"train.report_to: {tracker} is named twice; name each tracker once")
        missing = [m for m in TRACKER_MODULES[tracker] if importlib.util.find_spec(m) is None]
        if missing:
            raise BadInput(
                f"train.report_to: {tracker} needs the {tracker} extra ({', '.join(missing)} not installed): "
                f"pip install 'lcsb[{tracker}]'"
            )


def _validate_best(train) -> None:
    """keep_best and early stopping read the held-out loss of train.eval_every's evaluations."""
    for key, value in (("keep_best", train.keep_best), ("early_stopping_patience", train.early_stopping_patience)):
        if value and not train.eval_every:
            raise BadInput(
                f"train.{key}: reads the held-out loss of train.eval_every's evaluations, and train.eval_every is 0; "
                "set train.eval_every=N (N > 0)"
            )
    if train.early_stopping_min_delta and not train.early_stopping_patience:
        raise BadInput(
            "train.early_stopping_min_delta: counts only with train.early_stopping_patience=N (N > 0); set both"
        )


def _validate_format_keys(data: DataConfig) -> None:
    """A data key the format does not read is an error, never silence (it is set when it differs from its default)."""
    for f in dataclasses.fields(data):
        formats = f.metadata.get("formats")
        if formats and data.format not in formats and getattr(data, f.name) != f.default:
            raise BadInput(
                f"data.{f.name}: format {data.format} does not use it (only {', '.join(formats)}); remove it, or "
                f"override it with its default (data.{f.name}={json.dumps(f.default)})"
            )


def _validate_objective(recipe: Recipe) -> None:
    """Each objective reads its own data: dpo and orpo pairs, kto thumbs up/down, sft every other format."""
    objective, fmt = recipe.objective, recipe.data.format
    fits = OBJECTIVE_FORMATS.get(objective)
    if fits is None and fmt in ("preference", "feedback"):
        raise BadInput(f"objective: sft does not learn from format {fmt}; set objective=dpo, orpo or kto")
    if fits is not None and fmt not in fits:
        raise BadInput(f"objective: {objective} learns from data.format {fits[0]}, not {fmt}")
    if not recipe.preference.label_smoothing < 0.5:
        raise BadInput(f"preference.label_smoothing: {recipe.preference.label_smoothing} must be below 0.5")


def _validate_columns(data: DataConfig) -> None:
    """data.columns: roles of the format, each naming its own column."""
    roles = COLUMN_ROLES[data.format]
    for role, column in data.columns.items():
        if role not in roles:
            raise BadInput(
                f"data.columns: {role!r} is not a role of format {data.format}; its roles are {', '.join(roles)}, "
                f"e.g. data.columns: {{{roles[-1]}: your_column}}"
            )
        if not isinstance(column, str) or not column.strip():
            raise BadInput(f"data.columns: {role} must name a column, got {column!r}")
    if len(set(data.columns.values())) < len(data.columns):
        raise BadInput(f"data.columns: two roles name the same column ({data.columns}); give each its own")


def _validate_data_file(data: DataConfig) -> None:
    """jsonl, text, completion, chat: one training file, one adapter, held out by data.eval or data.eval_fraction."""
    if data.train is None:
        raise BadInput(f"data.train: no file given (format {data.format}: {DATA_FILES[data.format]})")
    if data.user == "all" or (data.user is not None and data.format != "jsonl"):
        raise BadInput(f"data.user: per-user runs are for LaMP-2; a {data.format} file trains one adapter (set null)")
    if (data.format == "jsonl" or data.eval is None) and not 0 < data.eval_fraction < 1:
        raise BadInput(f"data.eval_fraction: {data.eval_fraction} must be between 0 and 1 (the share held out)")


def replace_key(recipe: Recipe, dotted: str, value) -> Recipe:
    """A copy of `recipe` with one dotted key changed."""
    *parents, leaf = dotted.split(".")
    copy = dataclasses.replace(recipe)
    node = copy
    for part in parents:
        child = dataclasses.replace(getattr(node, part))
        setattr(node, part, child)
        node = child
    setattr(node, leaf, value)
    return copy


def get_key(recipe: Recipe, dotted: str):
    value = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def resolved_autocast(recipe: Recipe) -> str:
    """The run's autocast, none | bf16: what `with_autocast_chosen`, the one place that decides, picks."""
    return with_autocast_chosen(recipe)[0].train.autocast


def with_autocast_chosen(recipe: Recipe) -> tuple[Recipe, str]:
    """The recipe with `train.autocast: auto` replaced by what it picks on this machine (so a run's config.yaml says
    what ran, and its resume on another host keeps it), and the line that says why. Another setting stays as it is;
    its line is empty unless it asks for bf16 that this CPU would emulate."""
    mode, why = choose_autocast(recipe.train.autocast, recipe.backend)
    if recipe.train.autocast == "auto":
        return replace_key(recipe, "train.autocast", mode), why
    if mode == "bf16" and recipe.backend == "cpu" and native_bf16_flag() is None:
        return recipe, "warning: train.autocast: bf16 on a CPU without native bf16 is emulated, slower than fp32"
    return recipe, ""
