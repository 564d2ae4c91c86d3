"""Recipes: YAML -> typed dataclasses, dotted KEY=VALUE overrides, validation with clear errors."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import BadInput
from .recipe_yaml import apply_override, build, resolve_paths
from .selective.choices import IDLE_UPDATES, SCHEDULES, UPPER_PATHS
from .window import parse_window

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelConfig:  # name: a preset (configs/models/NAME.yaml), a local HF dir or a .gguf file; dtype: frozen weights
    name: str = "tiny-qwen2"
    dtype: str = "float32"
    trust_remote_code: bool = False


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    backward: str = "autograd"  # autograd (peft's layers) | mesp (saves only x; recomputes xA in backward)


@dataclass
class LcsbConfig:
    blocks: int = 4
    schedule: str = "cyclic"
    upper_path: str = "exact"  # exact: measured better than the paper's identity on a real model (docs/RESULTS.md)
    exact_above: int = 0  # identity path: layers just above the active block that backpropagate exactly (LoRA frozen)
    idle_update: str = "momentum"


@dataclass
class NpuSimConfig:
    device: str = "snapdragon-8gen3"  # a profile in configs/devices/ or a path to a profile YAML
    weights: str = "int8"  # the NPU's resident weight format: fp16 | int8 (per channel) | int4 (groups of 32)
    precision: str = "auto"  # auto: per layer by calibrated input-gradient error (npu-sim: fp16, else fp32;
    # npu-htp: the first of w8a8, w8a16, fp16 within the threshold, else fp32) | fp16 | fp32 | w8a16 | w8a8
    row_protection: bool = True  # per-row power-of-two scaling around every FP16 cast
    overlap: bool = True  # NPU products on a worker thread while the CPU computes the adapters
    fuse_cpu_ops: bool = True  # the CPU lane's elementwise chains (norms, RoPE, softmax, SiLU x up) as fused kernels
    calibration_steps: int = 4  # precision=auto: steps measuring each layer's fp16 input-gradient error (>= K
    # covers every block); a layer that got no input gradient in them stays fp16
    fp32_threshold: float = 0.01  # precision=auto: relative error above which a layer moves to fp32 (npu-htp: up
    # to the next, more precise, precision)


@dataclass
class DataConfig:
    format: str = "lamp2"  # lamp2 (LaMP-2 JSON) | jsonl (phone labels) | text | completion | chat (see data/lm.py)
    train: str | None = None
    train_labels: str | None = None
    eval: str | None = None
    eval_labels: str | None = None
    max_length: int = 256
    profile_k: int = 0  # prepend the k most relevant profile items (BM25) to each question
    user: str | None = None  # train/evaluate one user's adapter (a user id), or one adapter per user (all)
    eval_fraction: float = 0.2  # held out without data.eval: jsonl the newest items, text/completion/chat a seeded draw
    on_bad_line: str = "error"  # jsonl, text, completion, chat: error (stop, naming the line) | skip (count it)
    labels: list[str] | None = None  # jsonl: the label set; null infers it from the data


@dataclass
class OvernightConfig:
    window: str | None = None  # "HH:MM-HH:MM": wait for the start, stop (checkpointed) at the end
    max_minutes: float = 0.0  # stop (checkpointed) after this many minutes of this process; 0: no limit
    max_temp_c: float = 0.0  # pause while the device is hotter than this; 0: never
    report: bool = False  # eval before and after training, report.md + report.json in the run dir


@dataclass
class TrainConfig:
    max_steps: int = 200
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    lr_scheduler: str = "cosine"
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 0
    log_every: int = 1
    save_every: int = 50  # 0: only at the end
    eval_every: int = 0  # log held-out metrics (eval_loss, eval_accuracy, ...) every N steps; 0: never
    autocast: str = "none"
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    optimizer: str = "adamw"  # adamw (torch, fp32 moments) | adamw8bit (bitsandbytes, block-wise 8-bit moments)
    report_to: list[str] = field(default_factory=list)  # trackers fed the metrics.jsonl rows: [tensorboard]


@dataclass
class FreezeConfig:
    layers: int = 6  # LoRA trains on the top this many layers only


@dataclass
class LisaConfig:
    layers: int = 2  # layers trained at a time
    interval: int = 20  # steps between fresh random draws


@dataclass
class MezoConfig:
    eps: float = 1e-3  # SPSA perturbation scale
    lr: float = 1e-6  # MeZO's own learning rate (train.lr is for the gradient methods)


@dataclass
class DivergenceConfig:
    action: str = "rollback"  # stop | skip | rollback
    spike_factor: float = 4.0  # a loss above this x the running median of recent losses is a spike
    patience: int = 3  # spikes in a row that count as divergence (a non-finite loss counts at once)
    lr_backoff: float = 0.5  # rollback multiplies the learning rate by this
    snapshot: str = "memory"  # the state a divergence returns to: memory | disk (run_dir/snapshot/) | none (stop only)


@dataclass
class EvalConfig:
    mode: str = "score"  # score: rank the tags by likelihood | generate: greedy decoding, exact match
    batch_size: int = 8  # questions per forward pass
    max_new_tokens: int = 8  # generate mode
    stop: list[str] = field(default_factory=list)  # generated answers end before the first of these ("\n": one line)


@dataclass
class MemoryConfig:
    streamed_load: bool = False  # build on the meta device, quantize one module at a time (quantization nf4 | fp4)
    embedding: str = "keep"  # keep (model.dtype) | nf4 | fp4: the embedding and LM head (streamed_load only)
    malloc_mmap_threshold_kb: int = 0  # glibc: blocks above this are mmapped and returned when freed; 0: default
    kernel_cache: int = 0  # oneDNN / ideep kernels cached (one per matmul shape); 0: their default, 1024


@dataclass
class Recipe:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: str = "none"
    lora: LoraConfig = field(default_factory=LoraConfig)
    method: str = "lcsb"
    lcsb: LcsbConfig = field(default_factory=LcsbConfig)
    activation_checkpointing: bool = False
    backend: str = "cpu"
    npu_sim: NpuSimConfig = field(default_factory=NpuSimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lisa: LisaConfig = field(default_factory=LisaConfig)
    mezo: MezoConfig = field(default_factory=MezoConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    overnight: OvernightConfig = field(default_factory=OvernightConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    output_dir: str | None = None  # default: runs/NAME


CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "quantization": ("none", "int8", "nf4", "fp4"),
    "method": ("lcsb", "full-backprop", "freeze", "lisa", "mezo"),
    "lcsb.schedule": SCHEDULES,
    "lcsb.upper_path": UPPER_PATHS,
    "lcsb.idle_update": IDLE_UPDATES,
    "backend": ("cpu", "cuda", "npu-sim", "npu-htp"),
    "npu_sim.weights": ("fp16", "int8", "int4"),
    "npu_sim.precision": ("auto", "fp16", "fp32", "w8a16", "w8a8"),
    "data.format": ("lamp2", "jsonl", "text", "completion", "chat"),
    "data.on_bad_line": ("error", "skip"),
    "train.lr_scheduler": ("cosine", "linear", "constant"),
    "train.autocast": ("none", "bf16"),
    "train.optimizer": ("adamw", "adamw8bit"),
    "eval.mode": ("score", "generate"),
    "divergence.action": ("stop", "skip", "rollback"),
    "divergence.snapshot": ("memory", "disk", "none"),
    "lora.backward": ("autograd", "mesp"),
    "memory.embedding": ("keep", "nf4", "fp4"),
}
MINIMUMS = {
    "lora.rank": 1, "lcsb.blocks": 1, "data.max_length": 16, "train.max_steps": 1, "train.batch_size": 1,
    "train.grad_accum": 1, "train.warmup_steps": 0, "train.log_every": 1, "train.save_every": 0, "train.threads": 0,
    "train.eval_every": 0, "data.profile_k": 0, "eval.batch_size": 1, "eval.max_new_tokens": 1,
    "divergence.spike_factor": 1.0, "divergence.patience": 1, "divergence.lr_backoff": 0.0, "freeze.layers": 1,
    "lisa.layers": 1, "lisa.interval": 1, "lora.dropout": 0.0, "train.weight_decay": 0.0, "train.max_grad_norm": 0.0,
    "npu_sim.calibration_steps": 1, "npu_sim.fp32_threshold": 0.0, "overnight.max_minutes": 0.0,
    "overnight.max_temp_c": 0.0, "memory.malloc_mmap_threshold_kb": 0, "memory.kernel_cache": 0, "lcsb.exact_above": 0}
DATA_FILES = {"jsonl": "phone-collected labels, one JSON object a line", "text": ".txt or JSONL {\"text\"}",
              "completion": "JSONL {\"prompt\", \"completion\"}", "chat": "JSONL {\"messages\"}"}


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
        raise BadInput(f"{path}: cannot be read as UTF-8 text ({exc.__class__.__name__}); save it as UTF-8 YAML") from exc
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
    recipe = build(Recipe, raw, "", source=source)
    validate(recipe)
    return recipe


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
        raise BadInput(f"divergence.snapshot: none keeps no state to {recipe.divergence.action} to; set "
                       "divergence.action=stop (the last checkpoint is the state to resume from) or snapshot=disk")
    if recipe.lora.dropout >= 1:
        raise BadInput(f"lora.dropout: {recipe.lora.dropout} must be below 1")
    if recipe.lora.backward == "mesp" and recipe.lora.dropout:
        raise BadInput(f"lora.backward: mesp recomputes xA from x and keeps no dropout mask; set lora.dropout=0 "
                       f"(not {recipe.lora.dropout}) or lora.backward=autograd")
    for key in ("lora.alpha", "mezo.eps", "mezo.lr", "train.lr"):
        if get_key(recipe, key) <= 0:
            raise BadInput(f"{key}: {get_key(recipe, key)} must be positive")
    _validate_npu(recipe)
    _validate_memory(recipe)
    _validate_trackers(recipe.train.report_to)
    if not recipe.lora.targets:
        raise BadInput("lora.targets: name at least one module, e.g. [q_proj, v_proj]")
    if recipe.data.format in DATA_FILES:
        _validate_data_file(recipe.data)
    elif recipe.data.train is None and recipe.data.user is None:
        raise BadInput("data.train: no training file given (a LaMP-2 *_questions.json)")
    elif recipe.data.user is not None and recipe.data.eval is None:
        raise BadInput("data.eval: per-user runs (data.user) need the users' questions file")
    if recipe.overnight.window is not None:
        parse_window(recipe.overnight.window)


def _validate_npu(recipe: Recipe) -> None:
    import importlib.util

    npu = recipe.npu_sim
    if recipe.backend in ("npu-sim", "npu-htp") and (recipe.quantization, recipe.train.autocast) != ("none", "none"):
        raise BadInput(f"quantization, train.autocast: {recipe.backend} keeps its own resident weights and product "
                       "precision (npu_sim.weights, npu_sim.precision); set quantization=none and train.autocast=none")
    if npu.precision in ("w8a16", "w8a8") and npu.weights != "int8":
        raise BadInput(f"npu_sim.precision: {npu.precision} products read int8 weights; set npu_sim.weights=int8")
    if recipe.backend != "npu-htp":
        return
    if npu.weights != "int8":
        raise BadInput(f"npu_sim.weights: npu-htp holds int8 weights on HTP, not {npu.weights}; set npu_sim.weights=int8")
    if importlib.util.find_spec("onnxruntime_qnn") is None or importlib.util.find_spec("onnx") is None:
        raise BadInput("backend: npu-htp needs onnxruntime-qnn and onnx: pip install -e '.[npu]'")


def _validate_memory(recipe: Recipe) -> None:
    if recipe.memory.streamed_load and recipe.quantization not in ("nf4", "fp4"):
        raise BadInput(f"memory.streamed_load: builds 4-bit models; set quantization=nf4 (or fp4), "
                       f"not {recipe.quantization}")
    if recipe.memory.streamed_load and recipe.backend != "cpu":
        raise BadInput("memory.streamed_load: the streamed 4-bit build runs on backend=cpu")
    if recipe.memory.streamed_load and recipe.model.trust_remote_code:
        raise BadInput("memory.streamed_load: builds transformers' own architectures; a model that needs "
                       "model.trust_remote_code loads with memory.streamed_load=false")
    if recipe.memory.embedding != "keep" and not recipe.memory.streamed_load:
        raise BadInput("memory.embedding: a 4-bit embedding / LM head needs memory.streamed_load=true")


def _validate_trackers(trackers: list[str]) -> None:
    import importlib.util

    for tracker in trackers:
        if tracker != "tensorboard":
            raise BadInput(f"train.report_to: {tracker!r} is not a known tracker; choose from tensorboard")
        if importlib.util.find_spec("tensorboard") is None:
            raise BadInput("train.report_to: tensorboard needs the tensorboard package: pip install 'lcsb[tensorboard]'")


def _validate_data_file(data: DataConfig) -> None:
    """jsonl, text, completion, chat: one training file, one adapter, held out by data.eval or data.eval_fraction."""
    if data.train is None:
        raise BadInput(f"data.train: no file given (format {data.format}: {DATA_FILES[data.format]})")
    if data.user == "all" or (data.user is not None and data.format != "jsonl"):
        raise BadInput(f"data.user: per-user runs are for LaMP-2; a {data.format} file trains one adapter (set null)")
    if (data.format == "jsonl" or data.eval is None) and not 0 < data.eval_fraction < 1:
        raise BadInput(f"data.eval_fraction: {data.eval_fraction} must be between 0 and 1 (the share held out)")
    if data.format != "jsonl" and (data.labels, data.train_labels, data.eval_labels) != (None, None, None):
        raise BadInput(f"data.format: {data.format} has no labels; remove data.labels, train_labels, eval_labels")


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
