"""LoRA adapters as GGUF files in llama.cpp's adapter format, served by `llama-server --lora`.

The format is what llama.cpp's convert_lora_to_gguf.py writes and its llama-adapter.cpp loads: `general.type =
adapter`, `adapter.type = lora`, `adapter.lora.alpha` (float32) and `general.architecture` = the base's; for each
adapted matrix `W` (llama.cpp's name, e.g. `blk.0.attn_q.weight`) the tensors `W.lora_a` of shape [r, in] and
`W.lora_b` of shape [out, r] in torch order (ggml's `ne` reversed; the loader checks `a.ne[0] == W.ne[0]`, `b.ne[1]
== W.ne[1]`, `a.ne[1] == b.ne[0]`). llama.cpp adds `scale * alpha / r * B(A x)` with r read from lora_b, so PEFT's
`alpha / r` carries over unchanged. Llama stores q/k rows with the rotary halves interleaved: lora_b of q_proj and
k_proj (their output rows) gets the merged export's permutation; Phi-3's fused qkv_proj and gate_up_proj adapt
llama.cpp's attn_qkv and ffn_up, whose rows are HF's. Tensors are F32 (the converter's default) or F16.
No weight of the base is read: its architecture, layer and head counts come from its GGUF file or its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import BadInput
from ..adapter import ARCHITECTURES, PEFT_PREFIX, Adapter
from . import convert as gguf_in
from . import write as gguf_out

# --outtype of an adapter GGUF -> numpy dtype (the GGML type follows it)
OUTTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True)
class Base:
    """What an adapter GGUF needs of its base: llama.cpp's architecture name, the decoder's layer and head counts,
    and the base's GGUF file (None for an HF checkpoint)."""

    arch: str
    layers: int
    heads: int
    kv_heads: int
    gguf: Path | None


def base_of(recipe) -> Base:
    """The run's base, read from its GGUF file's metadata or its config.json; BadInput for an architecture that has
    no adapter GGUF here."""
    from ..load import gguf_source

    source = gguf_source(recipe.model.name)
    return _gguf_base(source) if source is not None else _hf_base(recipe)


def _gguf_base(path: Path) -> Base:
    import gguf

    gguf_in.check_magic(path)
    fields = gguf.GGUFReader(path).fields
    arch = str(fields["general.architecture"].contents())
    if arch not in ARCHITECTURES.values():
        raise BadInput(
            f"--format gguf: lcsb writes LoRA adapter GGUF for {', '.join(sorted(set(ARCHITECTURES.values())))} "
            f"bases, not the {arch!r} GGUF {path.name}; export the PEFT adapter (no --format) instead"
        )
    heads = int(fields[f"{arch}.attention.head_count"].contents())
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = int(fields[kv_key].contents()) if kv_key in fields else heads
    return Base(arch, int(fields[f"{arch}.block_count"].contents()), heads, kv_heads, path.resolve())


def _hf_base(recipe) -> Base:
    from ..load import check_causal_lm, resolve_base_dir

    base_dir = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    config = check_causal_lm(base_dir, recipe.model.trust_remote_code)
    if config.model_type not in ARCHITECTURES:
        raise BadInput(
            f"--format gguf: lcsb writes LoRA adapter GGUF for {', '.join(sorted(ARCHITECTURES))} models, not "
            f"{config.model_type!r}; export the PEFT adapter (no --format) instead"
        )
    arch = ARCHITECTURES[config.model_type]
    return Base(arch, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, None)


def write_adapter(adapter: Adapter, base: Base, target: Path, outtype: str, name: str) -> None:
    """Write the checked PEFT adapter `adapter` to `target` as llama.cpp's adapter GGUF, its matrices in `outtype`."""
    import gguf

    writer = gguf.GGUFWriter(target, base.arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.config.lora_alpha))
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for tensor_name, data in lora_tensors(adapter, base):
        writer.add_tensor(tensor_name, data.astype(OUTTYPES[outtype]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def lora_tensors(adapter: Adapter, base: Base):
    """(llama.cpp name, float32 array) of every lora_a and lora_b, in the adapter file's order."""
    weights = adapter.tensors
    names = gguf_out.tensor_names(base.arch, base.layers)
    for key, lora_a in weights.items():
        if key.endswith(".lora_B.weight"):
            continue
        if not key.endswith(".lora_A.weight"):
            raise BadInput(
                f"{adapter.source}: the tensor {key} is not a LoRA A/B matrix; llama.cpp's adapter holds no other"
            )
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        name = names.get_name(module)
        if name is None:
            raise BadInput(f"--format gguf: the adapted layer {module} has no llama.cpp name in a {base.arch} model")
        lora_b = weights[key.replace(".lora_A.", ".lora_B.")].float().numpy()
        yield f"{name}.weight.lora_a", lora_a.float().numpy()
        yield f"{name}.weight.lora_b", _output_rows(lora_b, name, base)


def _output_rows(lora_b: np.ndarray, name: str, base: Base) -> np.ndarray:
    """lora_b's rows in llama.cpp's order: for llama's q/k, the rotary halves interleaved per head."""
    if base.arch in gguf_out.ROTARY_INTERLEAVED and name.endswith(("attn_q", "attn_k")):
        return gguf_out.interleave_rotary(lora_b, base.heads if name.endswith("attn_q") else base.kv_heads)
    return lora_b
