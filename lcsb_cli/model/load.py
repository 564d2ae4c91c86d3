"""Model + tokenizer (a local HF checkpoint, a .gguf file or a built-in preset), quantization and LoRA via peft."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from .. import atomic
from ..errors import BadInput
from ..paths import CONFIGS_DIR, cache_root
from ..recipe import Recipe
from ..recipe.schema import ALL_LINEAR
from . import adapter as adapters
from . import memory, streamed
from .gguf import convert as gguf_in
from .tokenizer import load_tokenizer

PRESET_DIR = CONFIGS_DIR / "models"
TOKENIZER_DIR = CONFIGS_DIR / "tokenizers"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    # the PeftModel
    model: nn.Module
    tokenizer: object
    # the decoder layers, in order
    layers: nn.ModuleList
    # the checkpoint the base weights came from (a streamed random-init preset: its tokenizer)
    base_dir: Path
    # resident set size when this process first loaded a model: interpreter + libraries
    runtime_mb: float = 0.0
    # what the loss and the memory breakdown measure
    probe: memory.MemoryProbe | None = None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def resolve_base_dir(name: str, dtype: str = "float32") -> Path:
    """A local checkpoint dir as given, a GGUF file or GGUF preset converted once into the cache (in `dtype`), or a
    random-init preset materialised once into the cache."""
    if name in preset_names():
        return materialize_preset(name, dtype)
    path = Path(name).expanduser()
    if gguf_in.is_gguf_name(name):
        return gguf_in.converted_checkpoint(path, DTYPES[dtype], cache_root() / "gguf")
    if not path.exists():
        raise BadInput(
            f"model.name: {name!r} is neither a built-in preset ({', '.join(preset_names())}), "
            "a .gguf file nor an existing checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise BadInput(f"model.name: {path} has no config.json; point it at a dir written by save_pretrained")
    return path


def gguf_source(name: str) -> Path | None:
    """The GGUF file a model name stands for (a .gguf path or a GGUF preset), or None."""
    if name in preset_names():
        spec = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
        return preset_gguf_file(name, spec["gguf"]) if "gguf" in spec else None
    return Path(name).expanduser() if gguf_in.is_gguf_name(name) else None


def portable_name(name: str) -> str:
    """How adapters name their base: the preset, the GGUF file's name, or the checkpoint dir as given."""
    return Path(name).name if gguf_in.is_gguf_name(name) else name


def preset_gguf_file(name: str, spec: dict) -> Path:
    """A GGUF preset's file inside its installed package, found through the import system (without importing the
    package, whose own dependencies lcsb does not need), or assembled once from the package's chunks."""
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise BadInput(f"model.name: the preset {name} needs the package {spec['package']}: {spec['install']}")
    if "assemble" in spec:
        return _assembled_gguf(spec)
    path = Path(next(iter(found.submodule_search_locations))) / spec["file"]
    if not path.is_file():
        raise BadInput(f"model.name: {path} is missing from {spec['package']}; reinstall it: {spec['install']}")
    return path


def _assembled_gguf(spec: dict) -> Path:
    """The package's `assemble(path)` writes the file from its chunk packages, checking its SHA-256; once, under a
    lock, renamed into place when whole."""
    from filelock import FileLock

    target = cache_root() / "gguf-files" / spec["assemble"]
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / ".assemble.lock")):
        if not target.is_file():
            package = importlib.import_module(spec["package"])
            atomic.write_file(target, lambda tmp: package.assemble(tmp, overwrite=True))
    return target


def check_checkpoint_files(path: Path) -> None:
    """Weights and a tokenizer must be there: without tokenizer files transformers builds an empty tokenizer
    that silently encodes every text to nothing."""
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise BadInput(f"model.name: {path} has no weights ({' or '.join(WEIGHT_FILES)}); save the model there")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(
            f"model.name: {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
            "save the tokenizer there too (tokenizer.save_pretrained)"
        )


def materialize_preset(name: str, dtype: str = "float32") -> Path:
    """A pretrained preset's shipped checkpoint, its GGUF file converted into the cache, or the preset's
    deterministic random-init weights and tokenizer written once as an HF checkpoint into the cache."""
    spec_text = (PRESET_DIR / f"{name}.yaml").read_text()
    spec = yaml.safe_load(spec_text)
    if "checkpoint" in spec:
        return PRESET_DIR / spec["checkpoint"]
    if "gguf" in spec:
        return gguf_in.converted_checkpoint(preset_gguf_file(name, spec["gguf"]), DTYPES[dtype], cache_root() / "gguf")
    tokenizer_dir = TOKENIZER_DIR / spec["tokenizer"]
    tokenizer_text = "".join((tokenizer_dir / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json"))
    digest = hashlib.sha256((spec_text + tokenizer_text).encode()).hexdigest()
    target = cache_root() / "presets" / f"{name}-{digest[:12]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(spec["architecture"], **spec["config"])
    if spec.get("init") == "streamed":
        model = streamed.streamed_model(config, torch.float32, None, "keep", _random_init(spec, config))
    else:
        with memory.seeded(spec.get("seed", 0)):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)

    atomic.write_dir(target, write)
    return target


def _random_init(spec: dict, config) -> streamed.RandomInit:
    return streamed.RandomInit(spec.get("seed", 0), getattr(config, "initializer_range", None) or 0.02)


def check_causal_lm(path: Path, trust_remote_code: bool):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise BadInput(f"model.name: cannot read the model config in {path}: {exc}".splitlines()[0]) from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise BadInput(f"model.name: {path} holds a {config.model_type!r} model, not a causal language model")
    return config


def quantization_config(kind: str, compute_dtype: torch.dtype):
    if kind == "none":
        return None
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=True,
    )


def load_base(recipe: Recipe, device: torch.device):
    """(base model, its config, checkpoint dir), quantized as the recipe asks, with the KV cache off."""
    from transformers import AutoModelForCausalLM

    if recipe.memory.streamed_load and recipe.quantization in ("nf4", "fp4"):
        return _load_streamed(recipe)
    if recipe.quantization == "gguf":
        return _load_packed(recipe)
    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    if recipe.model.trust_remote_code:
        warnings.warn(f"model.trust_remote_code is on: Python code shipped in {base_dir} will run", stacklevel=2)
    config = check_causal_lm(base_dir, recipe.model.trust_remote_code)
    check_checkpoint_files(base_dir)
    dtype = DTYPES[recipe.model.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        base_dir,
        dtype=dtype,
        quantization_config=quantization_config(recipe.quantization, dtype),
        trust_remote_code=recipe.model.trust_remote_code,
        device_map={"": device} if recipe.quantization != "none" else None,
    )
    if recipe.quantization == "none":
        model.to(device)
    model.config.use_cache = False
    return model, config, base_dir


def _load_streamed(recipe: Recipe):
    """memory.streamed_load: a safetensors checkpoint read one tensor at a time, or a random-init preset drawn
    module by module (`init: streamed`) and cached quantized on disk once; no full-precision model ever exists."""
    from transformers import AutoConfig

    name, dtype = recipe.model.name, DTYPES[recipe.model.dtype]
    spec_text = (PRESET_DIR / f"{name}.yaml").read_text() if name in preset_names() else ""
    spec = yaml.safe_load(spec_text) if spec_text else {}
    if spec.get("init") == "streamed":
        config = AutoConfig.for_model(spec["architecture"], **spec["config"])
        base_dir = TOKENIZER_DIR / spec["tokenizer"]
        cached = _quantized_cache(name, spec_text, recipe) / "model.safetensors"
        source = _open_cache(cached) or _random_init(spec, config)
    else:
        base_dir = resolve_base_dir(name, recipe.model.dtype)
        config = check_causal_lm(base_dir, recipe.model.trust_remote_code)
        check_checkpoint_files(base_dir)
        source, cached = streamed.SafetensorsCheckpoint(base_dir), None
    model = streamed.streamed_model(config, dtype, recipe.quantization, recipe.memory.embedding, source)
    if isinstance(source, streamed.RandomInit):
        atomic.write_dir(cached.parent, lambda tmp: streamed.save_quantized(model, tmp / cached.name))
    model.config.use_cache = False
    return model, config, base_dir


def _load_packed(recipe: Recipe):
    """quantization: gguf: the decoder's Linears keep the file's blocks (gguf/packed_base.py), built one module at a
    time on the meta device like the streamed build; the rest comes from the file's converted checkpoint."""
    from .gguf.packed_base import GgufPacked, open_packable

    source_file = gguf_source(recipe.model.name)
    if source_file is None:
        raise BadInput(
            f"quantization: gguf trains on a GGUF file's own blocks; model.name must be a .gguf file or a GGUF "
            f"preset, not {recipe.model.name!r}"
        )
    # before the conversion: a file the packed layers cannot read is refused at once
    index = open_packable(source_file)
    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    config = check_causal_lm(base_dir, recipe.model.trust_remote_code)
    source = GgufPacked(base_dir, index, config)
    model = streamed.streamed_model(config, DTYPES[recipe.model.dtype], "gguf", recipe.memory.embedding, source)
    model.config.use_cache = False
    return model, config, base_dir


def _quantized_cache(name: str, spec_text: str, recipe: Recipe) -> Path:
    """Keyed by everything that decides its bytes: the preset, its tokenizer, the quantization and dtype, and the
    library versions (transformers' `_init_weights` draws the init, bitsandbytes packs the 4-bit blocks)."""
    from importlib.metadata import version

    spec = yaml.safe_load(spec_text)
    tokenizer = (TOKENIZER_DIR / spec["tokenizer"] / "tokenizer.json").read_text()
    libraries = f"{version('transformers')}/{version('bitsandbytes')}"
    key = f"{spec_text}{tokenizer}{recipe.quantization}/{recipe.model.dtype}/{recipe.memory.embedding}/{libraries}"
    return cache_root() / "quantized" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _open_cache(path: Path) -> streamed.QuantizedFile | None:
    """The cached quantized preset, or None when there is none or it is unreadable (then it is removed and rebuilt)."""
    from safetensors import SafetensorError

    if not path.is_file():
        return None
    try:
        return streamed.QuantizedFile(path)
    except (SafetensorError, OSError):
        shutil.rmtree(path.parent, ignore_errors=True)
        return None


def load_model(recipe: Recipe, device: torch.device, adapter: Path | None = None) -> LoadedModel:
    """Base model (quantized if asked) with LoRA on `recipe.lora.targets` (fresh, or `adapter`'s weights)."""
    from peft import LoraConfig, get_peft_model

    from .mesp import use_mesp

    runtime_mb = memory.runtime_rss_mb()
    memory.configure_allocator(recipe.memory.malloc_mmap_threshold_kb)
    memory.limit_kernel_caches(recipe.memory.kernel_cache)
    model, config, base_dir = load_base(recipe, device)
    if adapter is not None:
        peft_model = adapters.load(model, adapter)
    else:
        targets = recipe.lora.targets
        if targets != [ALL_LINEAR]:
            _check_targets(model, targets)
        lora = LoraConfig(
            r=recipe.lora.rank,
            lora_alpha=recipe.lora.alpha,
            lora_dropout=recipe.lora.dropout,
            # peft's own rule for all-linear: every nn.Linear (and 4/8-bit Linear) but the output embedding
            target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else list(targets),
            task_type="CAUSAL_LM",
        )
        if recipe.lora.backward == "mesp":
            use_mesp(lora)
        with memory.seeded(recipe.train.seed):
            peft_model = get_peft_model(model, lora)
    peft_model.active_peft_config.base_model_name_or_path = portable_name(recipe.model.name)
    return LoadedModel(
        peft_model,
        load_tokenizer(base_dir),
        decoder_layers(peft_model, config),
        base_dir,
        runtime_mb,
        memory.MemoryProbe(peft_model),
    )


def decoder_layers(model: nn.Module, config) -> nn.ModuleList:
    """The ModuleList of decoder layers: the one named `...layers` holding num_hidden_layers modules."""
    count = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers") and len(module) == count:
            return module
    raise BadInput("model.name: could not find the decoder layers (a ModuleList of num_hidden_layers blocks)")


def _check_targets(model: nn.Module, targets: list[str]) -> None:
    leaf_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)}
    missing = [t for t in targets if t not in leaf_names]
    if missing:
        raise BadInput(
            f"lora.targets: {', '.join(missing)} not found in this model; its linear layers are "
            f"{', '.join(sorted(leaf_names))}"
        )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def _is_bnb_4bit(module: nn.Module) -> bool:
    """bitsandbytes' own Linear4bit (peft's LoRA wrapper of it shares the class name)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def inference_mode(model: nn.Module):
    """model.eval() + no_grad, except bitsandbytes 4-bit layers stay in training mode.

    On CPUs with AVX512-BF16, an eval-mode no-grad forward makes bitsandbytes repack 4-bit weights for its
    inference kernel; after that, training fails or silently loses gradients. Keeping those layers'
    `training` flag set avoids the repack; they have no other train/eval behaviour.
    """
    was_training = model.training
    model.eval()
    for module in model.modules():
        if _is_bnb_4bit(module):
            module.training = True
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
