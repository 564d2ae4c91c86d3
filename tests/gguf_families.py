"""Small random-init checkpoints of six families as the GGUF files users download: written in F16 (lcsb's own writer,
or the gguf package for Gemma 3, which lcsb does not export), then quantized by llama.cpp's own quantizer
(`llama_model_quantize` with its default parameters). Each file is built once per test session into $LCSB_CACHE,
under a lock of its own, so xdist workers share them.

Every decoder Linear has 256 or 512 input columns: the k-quants (Q2_K ... Q6_K, IQ4_XS) need rows in whole blocks
of 256, and llama.cpp falls back to other types where they are not.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "configs" / "tokenizers" / "lcsb-bpe"
COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=4096,
    max_position_embeddings=512,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=0,
)
# name -> (transformers model_type, its config beyond COMMON); three carry the rotary scaling of the family's
# downloads (Llama 3.2's frequency factors, Gemma 3 4B's linear factor 8, Phi-4-mini's LongRoPE), their original
# context a few tokens long so that it acts within the tests' rows
FAMILIES = {
    "llama": (
        "llama",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-64": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "qwen3-128": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # llama.cpp scales Gemma 3's attention by the head size (27B aside); a window shorter than the test rows, and six
    # layers so that one (the sixth) is global
    "gemma3": (
        "gemma3_text",
        dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=16,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            ),
        ),
    ),
    # Phi-4-mini's partial rotation (3/4 of each head: 24 frequencies) and LongRoPE
    "phi3": (
        "phi3",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            original_max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                short_factor=[1.0 + index / 16 for index in range(24)],
                long_factor=[1.0 + index / 2 for index in range(24)],
                original_max_position_embeddings=32,
            ),
        ),
    ),
}
# llama.cpp's file types (llama_ftype) by name
FILE_TYPES = {"Q4_K_M": 15, "Q8_0": 7, "Q2_K": 10, "Q3_K_M": 12, "IQ4_NL": 25, "IQ4_XS": 30, "TQ2_0": 37}


def cache_dir() -> Path:
    return Path(os.environ["LCSB_CACHE"]) / "gguf-families"


def family_file(family: str, file_type: str = "F16") -> Path:
    """The family's GGUF file in `file_type` (F16, or a llama.cpp file type of FILE_TYPES), built on first use."""
    from filelock import FileLock

    path = cache_dir() / f"{family}-{file_type}.gguf"
    cache_dir().mkdir(parents=True, exist_ok=True)
    # one lock per file: building one file takes the locks of the files it is made from
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            if file_type == "F16":
                _write_f16(family, path)
            else:
                quantize(family_file(family), path, file_type)
    return path


def checkpoint(family: str):
    """The family's random-init model (seeded; weights rounded to F16, so the F16 file holds them exactly)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    return model


def quantize(source: Path, target: Path, file_type: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = 2
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {file_type}")
    partial.rename(target)


def _write_f16(family: str, path: Path) -> None:
    from lcsb_cli.model.gguf.write import write_gguf

    partial = path.with_suffix(".partial")
    model = checkpoint(family)
    if family == "gemma3":
        _write_gemma3(model, partial)
    else:
        scaling = _rope_scaling(model)
        rope = model.config.rope_parameters
        # lcsb's writer writes a plain rotation; the scaling is added to its file as llama.cpp's converter writes it
        model.config.rope_parameters = {
            key: rope[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope
        } | {"rope_type": "default"}
        write_gguf(model, TOKENIZER, partial, "f16", None)
        if scaling is not None:
            _rewrite(partial, *scaling)
    partial.rename(path)


def _rope_scaling(model) -> tuple[dict, dict] | None:
    """(keys, tensors) llama.cpp's converter adds for the model's rotary scaling: Llama 3's `rope_freqs` (each
    frequency's divisor), LongRoPE's factor tensors with the original context and attention factor."""
    import numpy as np

    rope, rotary = model.config.rope_parameters, model.model.rotary_emb
    if rope["rope_type"] == "llama3":
        plain = type(rotary).compute_default_rope_parameters(model.config)[0]
        return {}, {"rope_freqs.weight": (plain / rotary.inv_freq).numpy()}
    if rope["rope_type"] == "longrope":
        keys = {
            "rope.scaling.attn_factor": (rotary.attention_scaling, "FLOAT32"),
            "rope.scaling.original_context_length": (rope["original_max_position_embeddings"], "UINT32"),
        }
        tensors = {
            f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], np.float32) for kind in ("short", "long")
        }
        return keys, tensors
    return None


def _rewrite(path: Path, keys: dict, tensors: dict) -> None:
    """The GGUF file at `path` again, with more architecture keys ({name: (value, GGUFValueType name)}) and F32
    tensors."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    rewritten = path.with_suffix(".rewrite")
    writer = gguf.GGUFWriter(rewritten, arch)
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, kind) in keys.items():
        writer.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType[kind])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, data in tensors.items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rewritten.rename(path)


def _write_gemma3(model, path: Path) -> None:
    """What llama.cpp's converter writes for Gemma 3: its keys, every norm weight + 1, and a sentencepiece
    vocabulary (`_write_spm_vocab`), as real Gemma files have."""
    import gguf
    import numpy as np

    from lcsb_cli.model.gguf.write import tensor_names

    config = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _write_spm_vocab(writer, config.vocab_size)
    names = tensor_names("gemma3", config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy() + (1 if base.endswith("norm") else 0)
        data = data.astype(np.float32 if data.ndim == 1 else np.float16)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_spm_vocab(writer, size: int) -> None:
    """A sentencepiece vocabulary of `size` tokens in Gemma's layout (pad, eos, bos, unk, the 256 byte tokens, then
    pieces best first), its pieces the lcsb-bpe tokenizer's spelt with "\u2581" for a space: transformers builds
    Gemma's tokenizer for it, and llama.cpp its own sentencepiece tokenizer."""
    import json

    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    T = gguf.TokenType
    unbyte = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = {}
    for token in json.loads((TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]:
        try:
            text = bytes(unbyte[char] for char in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            # a special token, or part of a character
            continue
        pieces[text.replace(" ", "\u2581")] = None
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = [*specials, *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    types = [T.CONTROL] * 3 + [T.UNKNOWN] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
    tokens += [f"<unused{index}>" for index in range(size - len(tokens))]
    types += [T.UNUSED] * (size - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(index) for index in range(size)])
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
