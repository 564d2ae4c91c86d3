"""GGUF files in: each file is converted once into an ordinary HF checkpoint, keyed by its content.

transformers reads GGUF itself (dequantizing every tensor); what it builds cannot be saved as it is, so the
conversion drops the GGUF quantizer and saves the dequantized weights in the recipe's dtype, with the file's own
tokenizer (chat template and EOS included) and generation config. From then on the base is a plain checkpoint:
bitsandbytes, the streamed 4-bit build, npu-sim and export all read it unchanged.

transformers' map from GGUF metadata to its config leaves out keys that llama.cpp reads; `gguf_config` gives them
to `from_pretrained` as config arguments, from the file as llama.cpp reads it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import torch

from ... import atomic
from ...errors import BadInput
from ...runtime import stderr_to_log
from .config import config_overrides
from .index import GgufIndex

MAGIC = b"GGUF"
# written last into a conversion; its presence marks the entry complete
PROVENANCE = "lcsb_gguf_source.json"
# the one file a conversion leaves besides its entry
LOCK = ".convert.lock"


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
    overrides = config_overrides(index.fields, index.tensors)
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
