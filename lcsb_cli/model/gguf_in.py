"""GGUF files in: each file is converted once into an ordinary HF checkpoint, keyed by its content.

transformers reads GGUF itself (dequantizing every tensor); what it builds cannot be saved as it is, so the
conversion drops the GGUF quantizer and saves the dequantized weights in the recipe's dtype, with the file's own
tokenizer (chat template and EOS included) and generation config. From then on the base is a plain checkpoint:
bitsandbytes, the streamed 4-bit build, npu-sim and export all read it unchanged.

transformers' map from GGUF metadata to its config leaves out keys that llama.cpp reads (Qwen3's head size,
Phi-3's rotary dimensions, Gemma 3's attention scale), so its config falls back to the class defaults for them;
`config_overrides` sets each from the file, as llama.cpp reads it, or refuses a file transformers cannot express.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import torch

from .. import atomic
from ..errors import BadInput
from ..runtime import stderr_to_log
from .gguf_index import GgufIndex

MAGIC = b"GGUF"
# written last into a conversion; its presence marks the entry complete
PROVENANCE = "lcsb_gguf_source.json"
# the one file a conversion leaves besides its entry
LOCK = ".convert.lock"
# the GGUF architectures whose transformers config was checked against what llama.cpp reads from the metadata
# (mistral files are llama); of those, the ones whose config takes head_dim (the others compute hidden_size / heads)
# and the ones whose model rotates part of each head (rope_parameters' partial_rotary_factor)
CHECKED = {"llama", "qwen2", "qwen3", "phi3", "gemma3"}
HEAD_DIM_IN_CONFIG = {"llama", "qwen3", "gemma3"}
PARTIAL_ROTARY = {"phi3"}
# Gemma 3 27B (62 layers) scales attention by hidden_size / heads, every other size by the head size (llama.cpp)
GEMMA3_27B_LAYERS = 62


def is_gguf_name(name: str) -> bool:
    return name.lower().endswith(".gguf")


def converted_checkpoint(path: Path, dtype: torch.dtype, cache: Path) -> Path:
    """The HF checkpoint converted from the GGUF file `path`, converting it first on a cache miss.

    The cache key is the file's SHA-256 plus the dtype, the config overrides and the transformers / gguf versions
    that convert it. Concurrent processes wait on one lock, so the file is converted once.
    """
    from filelock import FileLock

    check_magic(path)
    index = GgufIndex(path)
    overrides = config_overrides(index.fields)
    digest = file_sha256(path)
    libraries = f"{version('transformers')}/{version('gguf')}"
    recipe = f"{digest}/{dtype}/{json.dumps(overrides, sort_keys=True)}/{libraries}"
    target = cache / f"{path.stem}-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}"
    if (target / PROVENANCE).is_file():
        return target
    metadata = {**read_metadata(path, index), "sha256": digest, "config_overrides": overrides}
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / LOCK)):
        # absent, or an entry without its provenance: never used
        if not (target / PROVENANCE).is_file():
            atomic.write_dir(target, lambda tmp: _convert(path, tmp, dtype, metadata, overrides), replace=True)
    return target


def provenance(checkpoint: Path) -> dict | None:
    """What a converted checkpoint came from (None for any other checkpoint)."""
    path = checkpoint / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


def check_magic(path: Path) -> None:
    if not path.is_file():
        raise BadInput(f"model.name: {path} does not exist (a .gguf file, a preset or a checkpoint dir)")
    with path.open("rb") as handle:
        if handle.read(4) != MAGIC:
            raise BadInput(f"model.name: {path} is not a GGUF file (it does not start with the GGUF magic)")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: Path, index: GgufIndex) -> dict:
    """Architecture, quantization type and tensor types, from the file's header (`GgufIndex` refuses a cut-short or
    damaged file: it checks every tensor's extent against the file's size)."""
    import gguf

    file_type = index.fields.get("general.file_type")
    return {
        "source": str(path.resolve()),
        "architecture": index.architecture,
        "gguf_file_type": gguf.LlamaFileType(file_type).name if file_type is not None else None,
        "tensor_types": dict(Counter(tensor.tensor_type.name for tensor in index.tensors.values())),
    }


def config_overrides(fields: dict) -> dict:
    """The config values transformers' GGUF map does not read for this file, as llama.cpp reads the metadata: the
    head size (`attention.key_length`, else hidden size / heads), the rotary dimensions (`rope.dimension_count`,
    else the head size) and Gemma 3's attention scale. BadInput for a file that transformers' model of its
    architecture cannot hold. Architectures not in CHECKED keep transformers' own reading."""
    arch = fields["general.architecture"]

    def key(name: str, default=None):
        return fields.get(f"{arch}.{name}", default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    # per-layer head counts (an array, skipped by the index) or none: transformers' own map decides
    if arch not in CHECKED or not isinstance(heads, int) or not heads or not hidden:
        return {}
    head_dim = key("attention.key_length") or hidden // heads
    rotary = key("rope.dimension_count") or head_dim
    if key("attention.value_length", head_dim) != head_dim:
        raise _cannot_hold(
            arch, f"its values have {key('attention.value_length')} dimensions a head, its keys {head_dim}"
        )
    overrides = {}
    if arch in HEAD_DIM_IN_CONFIG:
        overrides["head_dim"] = head_dim
    elif head_dim != hidden // heads:
        raise _cannot_hold(arch, f"its heads have {head_dim} dimensions, not hidden size / heads")
    if rotary != head_dim:
        if arch not in PARTIAL_ROTARY:
            raise _cannot_hold(arch, f"it rotates {rotary} of each head's {head_dim} dimensions")
        theta = key("rope.freq_base", 10000.0)
        overrides["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": rotary / head_dim,
        }
    if arch == "gemma3":
        overrides["query_pre_attn_scalar"] = hidden // heads if key("block_count") == GEMMA3_27B_LAYERS else head_dim
    return overrides


def _cannot_hold(arch: str, why: str) -> BadInput:
    return BadInput(f"model.name: transformers' {arch} model cannot hold this GGUF file: {why}")


def _convert(path: Path, target: Path, dtype: torch.dtype, metadata: dict, overrides: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
    try:
        # transformers draws a tqdm bar over the file's tensors on stderr
        with stderr_to_log("transformers"):
            model = AutoModelForCausalLM.from_pretrained(
                **where, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **overrides
            )
            tokenizer = AutoTokenizer.from_pretrained(**where)
    except (ValueError, NotImplementedError, KeyError, OSError) as exc:
        raise BadInput(
            f"model.name: transformers cannot read the {metadata['architecture']!r} model in {path.name}: "
            f"{exc}".splitlines()[0]
        ) from exc
    # the weights are dequantized: what is left is an ordinary model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.use_cache = True
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    record = {
        **metadata,
        "dtype": str(dtype).removeprefix("torch."),
        "transformers": version("transformers"),
        "gguf": version("gguf"),
    }
    (target / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
