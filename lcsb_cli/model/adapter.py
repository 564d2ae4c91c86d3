"""Adapters in: the one place that reads a LoRA adapter (a PEFT dir, or an adapter GGUF that `lcsb export` wrote) and
checks it before any use.

What is checked: the config parses and holds the keys lcsb reads (`r`, `lora_alpha`, `target_modules`); the weights
file opens; its tensors are exactly those peft builds on the base from that config (every name there, none missing,
each shape the rank and the target layer's size give); an adapter GGUF has `general.type = adapter`, `adapter.type =
lora`, the base's architecture and every tensor whole. Anything else is BadInput naming the file and the problem: a
damaged adapter never reaches a model or an output. The expected tensors come from peft itself (`get_peft_model` on
the base, or on a meta-device copy of it when no weights are loaded), so plain peft adapters load as peft loads them.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..errors import BadInput
from .gguf import write as gguf_out

if TYPE_CHECKING:
    from peft import LoraConfig

# HF model_type -> GGUF architecture, for adapters: the merged export's and Gemma 3 (its q/k rows as in HF)
ARCHITECTURES = {**gguf_out.ARCHITECTURES, "gemma3_text": "gemma3"}
# what peft puts before a module's name in adapter_model.safetensors
PEFT_PREFIX = "base_model.model."

# the config keys lcsb reads, with what each must be
REQUIRED = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "lora_alpha": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "target_modules": (
        lambda v: isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(m, str) for m in v)),
        "a list of layer names",
    ),
}
# an adapter GGUF's matrices: llama.cpp's name of the adapted weight + these
GGUF_SUFFIXES = {".weight.lora_a": "lora_A", ".weight.lora_b": "lora_B"}
DAMAGED = "restore it, or train or export it again"


@dataclass
class Adapter:
    """A read adapter: the files it came from (for messages: its weights, its config; an adapter GGUF is both), its
    peft config and its tensors under peft's names (`base_model.model.<module>.lora_A.weight`)."""

    source: Path
    config_source: Path
    config: LoraConfig
    tensors: dict[str, torch.Tensor]


def read(path: Path, base: nn.Module) -> Adapter:
    """The adapter at `path` (a PEFT dir or an adapter GGUF), its config and weights checked on their own; `base`
    (the model it goes on, before peft wraps it) names an adapter GGUF's layers."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _read_gguf(path, base)
    return _read_peft(path)


def load(base: nn.Module, path: Path):
    """`base` with the checked adapter at `path` on it, trainable: the PeftModel."""
    from peft import set_peft_model_state_dict

    adapter = read(path, base)
    adapter.config.inference_mode = False
    model = fitted(base, adapter)
    set_peft_model_state_dict(model, adapter.tensors)
    return model


def load_into(model, path: Path) -> None:
    """Replace the LoRA tensors of the PeftModel `model` by those of the adapter at `path`, checked to fit it."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, check_fits(model, path).tensors)


def check_fits(model, path: Path) -> Adapter:
    """The adapter at `path`, whole and fitting the PeftModel `model`: the same rank, alpha and targets, and its
    tensors exactly the model's."""
    adapter = read(path, model.get_base_model())
    if _lora_shape(adapter.config) != _lora_shape(model.active_peft_config):
        raise BadInput(
            f"{adapter.config_source}: {_describe(adapter.config)} is not the {_describe(model.active_peft_config)} "
            f"of the model it goes on; {DAMAGED}"
        )
    check_tensors(model, adapter.tensors, adapter.source)
    return adapter


def check_for_base(path: Path, base_config, trust_remote_code: bool = False) -> Adapter:
    """The adapter at `path`, checked against a base with `base_config` built on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(base_config, trust_remote_code=trust_remote_code)
    adapter = read(path, base)
    fitted(base, adapter)
    return adapter


def fitted(base: nn.Module, adapter: Adapter):
    """peft's model of `adapter.config` on `base`, after checking that the adapter's tensors are exactly its own."""
    from peft import get_peft_model

    # the loader names the base; peft would warn that it renamed it
    adapter.config.base_model_name_or_path = None
    try:
        model = get_peft_model(base, adapter.config)
    except ValueError as exc:
        raise BadInput(f"{adapter.config_source}: {exc}".splitlines()[0]) from exc
    check_tensors(model, adapter.tensors, adapter.source)
    return model


def apply(model, tensors: dict[str, torch.Tensor], source) -> None:
    """Put `tensors` (peft's names) into the PeftModel `model`, once they are checked to be exactly its own."""
    from peft import set_peft_model_state_dict

    check_tensors(model, tensors, source)
    set_peft_model_state_dict(model, tensors)


def check_tensors(model, tensors: dict[str, torch.Tensor], source) -> None:
    """BadInput naming `source` unless `tensors` has every LoRA tensor of the PeftModel `model`, each in its shape, and
    nothing else."""
    from peft import get_peft_model_state_dict

    expected = {k: v.shape for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    config = model.active_peft_config
    targets = f"rank {config.r} on {_targets(config.target_modules)}"
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise BadInput(
            f"{source}: {len(missing)} of the {len(expected)} tensors of {targets} are missing, {missing[0]} the "
            f"first; {DAMAGED}"
        )
    for key, shape in expected.items():
        if tensors[key].shape != shape:
            raise BadInput(
                f"{source}: the tensor {key} has shape {list(tensors[key].shape)}, where {targets} of this base "
                f"needs {list(shape)}; {DAMAGED}"
            )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise BadInput(f"{source}: the tensor {extra[0]} has no place in {targets} of this base; {DAMAGED}")


def _targets(modules) -> str:
    return modules if isinstance(modules, str) else ", ".join(sorted(modules))


def _lora_shape(config) -> tuple:
    return config.r, config.lora_alpha, _targets(config.target_modules)


def _describe(config) -> str:
    return f"rank {config.r}, alpha {config.lora_alpha:g} on {_targets(config.target_modules)}"


def _read_peft(path: Path) -> Adapter:
    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    if not (path / CONFIG_NAME).is_file():
        raise BadInput(f"--adapter: {path} is not a PEFT adapter dir (no {CONFIG_NAME}) nor an adapter .gguf file")
    config = _config(path / CONFIG_NAME)
    weights = next((path / n for n in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME) if (path / n).is_file()), None)
    if weights is None:
        raise BadInput(f"{path}: the adapter has no weights ({SAFETENSORS_WEIGHTS_NAME}); {DAMAGED}")
    return Adapter(weights, path / CONFIG_NAME, config, _weights(weights))


def _config(file: Path):
    """peft's LoraConfig from adapter_config.json, once the keys lcsb reads are there and of their kind."""
    from peft import LoraConfig

    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{file}: not a readable JSON config ({exc}); {DAMAGED}") from exc
    if not isinstance(values, dict):
        raise BadInput(f"{file}: holds a JSON {type(values).__name__}, not a config object; {DAMAGED}")
    if values.get("peft_type", "LORA") != "LORA":
        raise BadInput(f"{file}: a {values['peft_type']} adapter; lcsb reads LoRA adapters only")
    for key, (valid, kind) in REQUIRED.items():
        if key not in values:
            raise BadInput(f"{file}: the config lacks {key!r}, which lcsb needs; {DAMAGED}")
        if not valid(values[key]):
            raise BadInput(f"{file}: {key} is {values[key]!r}, not {kind}; {DAMAGED}")
    try:
        return LoraConfig.from_peft_type(**{**values, "peft_type": "LORA"})
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{file}: peft refuses the config: {exc}".splitlines()[0]) from exc


def _weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter's weights file, read by peft as it reads them (a truncated or empty file, or a
    pickle of anything but tensors, is BadInput)."""
    from peft.utils import load_peft_weights
    from safetensors import SafetensorError

    try:
        return load_peft_weights(str(file.parent), device="cpu")
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise BadInput(f"{file}: the weights do not load ({exc}); {DAMAGED}".replace("\n", " ")) from exc


def _read_gguf(path: Path, base: nn.Module) -> Adapter:
    """An adapter GGUF (llama.cpp's format, as gguf/adapter.py writes it) back into peft's names, LoRA config and
    row order."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        tensors = {t.name: _float_tensor(t, path) for t in reader.tensors}
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise BadInput(f"{path}: truncated or damaged adapter GGUF ({exc}); {DAMAGED}".replace("\n", " ")) from exc
    kind = (fields.get("general.type"), fields.get(gguf.Keys.Adapter.TYPE))
    if kind != ("adapter", "lora"):
        raise BadInput(f"{path}: not a LoRA adapter GGUF (general.type={kind[0]}, adapter.type={kind[1]})")
    arch = ARCHITECTURES.get(base.config.model_type)
    if fields.get("general.architecture") != arch:
        raise BadInput(
            f"{path}: an adapter for a {fields.get('general.architecture')} base; this base is "
            f"{arch or base.config.model_type}"
        )
    peft_tensors = _peft_tensors(tensors, _modules_by_gguf_name(base, arch), base.config, arch, path)
    ranks = {t.shape[0] for k, t in peft_tensors.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise BadInput(f"{path}: the lora_a tensors have ranks {sorted(ranks)}, not one rank; {DAMAGED}")
    return Adapter(path, path, _gguf_config(fields, peft_tensors, ranks.pop(), path), peft_tensors)


def _float_tensor(tensor, path: Path) -> torch.Tensor:
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise BadInput(f"{path}: the tensor {tensor.name} is {tensor.tensor_type.name}; adapter GGUFs hold F32 or F16")
    return torch.from_numpy(np.array(tensor.data, dtype=np.float32))


def _modules_by_gguf_name(base: nn.Module, arch: str) -> dict[str, str]:
    """llama.cpp's name of each Linear of `base` -> its module name."""
    names = gguf_out.tensor_names(arch, base.config.num_hidden_layers)
    # a Linear that peft wrapped is its base_layer
    linears = (name.removesuffix(".base_layer") for name, m in base.named_modules() if isinstance(m, nn.Linear))
    return {gguf_name: name for name in linears if (gguf_name := names.get_name(name)) is not None}


def _peft_tensors(tensors: dict[str, torch.Tensor], modules: dict[str, str], config, arch: str, path: Path) -> dict:
    """An adapter GGUF's matrices under peft's names, lora_b's rows in HF's order."""
    renamed = {}
    for name, tensor in tensors.items():
        suffix = next((s for s in GGUF_SUFFIXES if name.endswith(s)), None)
        module = modules.get(name.removesuffix(suffix)) if suffix else None
        if module is None:
            raise BadInput(f"{path}: the tensor {name} is no LoRA matrix of a layer of this base")
        if suffix == ".weight.lora_b":
            tensor = _rows_in_hf_order(tensor, name.removesuffix(suffix), config, arch)
        renamed[f"{PEFT_PREFIX}{module}.{GGUF_SUFFIXES[suffix]}.weight"] = tensor
    return renamed


def _rows_in_hf_order(lora_b: torch.Tensor, name: str, config, arch: str) -> torch.Tensor:
    """Undo the export's rotary interleave of llama's q/k output rows (gguf_out.interleave_rotary)."""
    if arch not in gguf_out.ROTARY_INTERLEAVED or not name.endswith(("attn_q", "attn_k")):
        return lora_b
    heads = config.num_attention_heads if name.endswith("attn_q") else config.num_key_value_heads
    order = torch.from_numpy(gguf_out.interleave_rotary(np.arange(lora_b.shape[0]), heads))
    restored = torch.empty_like(lora_b)
    restored[order] = lora_b
    return restored


def _gguf_config(fields: dict, tensors: dict[str, torch.Tensor], rank: int, path: Path):
    import gguf
    from peft import LoraConfig

    alpha = fields.get(gguf.Keys.Adapter.LORA_ALPHA)
    if not isinstance(alpha, (int, float)):
        raise BadInput(f"{path}: the adapter GGUF has no {gguf.Keys.Adapter.LORA_ALPHA}; {DAMAGED}")
    # peft's names end in <module>.lora_A.weight
    modules = sorted({key.split(".")[-3] for key in tensors})
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, task_type="CAUSAL_LM")
