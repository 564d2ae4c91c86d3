"""GGUF files out: a merged model written as one GGUF file with the `gguf` package, readable by llama.cpp, and the
Ollama Modelfile that imports it.

A model that came from a GGUF file keeps that file's own metadata (architecture keys, tokenizer, chat template);
only its tensors and file type are new, and a tensor the model holds no weight for (Llama 3's rope_freqs, Phi-3's
rope factors) is copied from the file as it is. A model from an HF checkpoint gets what llama.cpp's converter writes for
its architecture (the keys below, a byte-level BPE vocabulary with its merges, special tokens and chat template).
Its checkpoint dir's name goes to `general.basename`, not `general.name`: transformers' GGUF loader reads a llama
file whose general.name is "mistral" as model_type mistral, so a name lcsb picked could change how it is read.
Phi-3's fused projections (qkv_proj, gate_up_proj) are llama.cpp's attn_qkv and ffn_up as they are: same row order
(q, k, v; gate, up) and no rotary permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ...errors import BadInput

OUTTYPES = ("f16", "bf16", "q8_0")
# HF model_type -> GGUF
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "phi3": "phi3", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp stores these archs' q/k rows with the rotary halves interleaved
ROTARY_INTERLEAVED = {"llama"}
# a byte-level BPE's split regex -> llama.cpp's tokenizer.ggml.pre (a plain ByteLevel split is "gpt-2")
SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",  # noqa: E501
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",  # noqa: E501
}
# the writer adds or replaces these
SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")


def check_exportable(model_type: str) -> str:
    """The GGUF architecture name for an HF model type, or BadInput naming the supported ones."""
    if model_type not in ARCHITECTURES:
        raise BadInput(
            f"--format gguf: lcsb writes GGUF for {', '.join(sorted(ARCHITECTURES))} models, "
            f"not {model_type!r}; export --merge --format hf and convert that with llama.cpp"
        )
    return ARCHITECTURES[model_type]


def modelfile(model: Path) -> str:
    """An Ollama Modelfile for the merged GGUF `model`, named by its absolute path: `ollama create NAME -f` takes it.

    FROM a merged file already at the type it runs in: Ollama 0.34.1 and later take no ADAPTER line or LoRA GGUF
    (ollama/ollama#14969) and no longer quantize on import, so `--outtype` is the served type. No TEMPLATE:
    Ollama's templates are Go templates and the file's tokenizer.chat_template (the base's) is Jinja, which lcsb does
    not translate; `ollama create` reads that template itself and takes the nearest of its own Go templates, with its
    stop words, when one is close (SmolLM2's matches chatml). No PARAMETER stop: llama.cpp already ends a reply at
    the vocabulary's end-of-generation tokens, and a stop line would replace the detected template's stop words.
    """
    return f"FROM {model.resolve()}\n"


def write_gguf(model, tokenizer_dir: Path, target: Path, outtype: str, source: Path | None) -> None:
    """Write the (merged, unquantized) `model` to `target`; `source` is the GGUF file it came from, if any."""
    import gguf

    arch = check_exportable(model.config.model_type)
    writer = gguf.GGUFWriter(target, arch)
    reader = gguf.GGUFReader(source) if source is not None else None
    if reader is not None:
        _copy_metadata(reader, writer)
    else:
        _write_model_keys(writer, model.config, tokenizer_dir.name)
        _write_tokenizer(writer, tokenizer_dir, model.config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{outtype.upper()}"))
    written = set()
    for name, data, kind in _tensors(model, arch, outtype):
        writer.add_tensor(name, data, raw_dtype=kind)
        written.add(name)
    # what the model holds no weight for, as the source has it: Llama 3's rope_freqs, Phi-3's rope_factors_short/long
    for tensor in reader.tensors if reader is not None else []:
        if tensor.name not in written:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_metadata(reader, writer) -> None:
    for key, field in reader.fields.items():
        if key.startswith(SKIPPED_KEYS):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _write_model_keys(writer, config, name: str) -> None:
    import gguf

    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise BadInput(
            f"--format gguf: rope scaling {rope['rope_type']!r} is not written by lcsb; "
            "export --merge --format hf and convert that with llama.cpp"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_basename(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if config.model_type == "phi3":
        # as llama.cpp's converter: 0 for none
        writer.add_sliding_window(config.sliding_window or 0)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE vocabulary as llama.cpp's converter writes it (`tokenizer.ggml.model = gpt2`)."""
    import gguf
    from transformers import AutoTokenizer

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[index])
            special = index in added and added[index].special
            types.append(
                gguf.TokenType.CONTROL
                if special
                else gguf.TokenType.USER_DEFINED
                if index in added
                else gguf.TokenType.NORMAL
            )
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    special_vocab.add_to_gguf(writer, quiet=True)
    if special_vocab.chat_template is None and tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _pre_tokenizer(spec: dict) -> str:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    kinds = [step.get("type") for step in steps]
    if spec.get("model", {}).get("type") == "BPE":
        if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
            return "gpt-2"
        if kinds == ["Split", "ByteLevel"] and steps[0]["pattern"].get("Regex") in SPLITS:
            return SPLITS[steps[0]["pattern"]["Regex"]]
    raise BadInput(
        "--format gguf: lcsb writes byte-level BPE tokenizers with the GPT-2, Qwen2 or Llama-3 split, "
        "and this tokenizer is another kind; export --merge --format hf and convert that with llama.cpp"
    )


def _tensors(model, arch: str, outtype: str):
    """(GGUF name, data, GGML type) for every tensor llama.cpp reads: 1-D tensors in F32, matrices in `outtype`."""
    config = model.config
    names = tensor_names(arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise BadInput(f"--format gguf: no GGUF name for the tensor {hf_name} of this {arch} model")
        data = tensor.detach().to(torch.float32).numpy()
        if arch in ROTARY_INTERLEAVED and name.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if name.endswith("attn_q") else config.num_key_value_heads
            data = interleave_rotary(data, heads)
        yield f"{name}.{suffix}", *_encode(data, outtype)


def tensor_names(arch: str, layers: int):
    """gguf's map from HF module names (`model.layers.0.self_attn.q_proj`) to llama.cpp's (`blk.0.attn_q`)."""
    import gguf

    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    return gguf.get_tensor_name_map(arch_id, layers)


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows: within each head, the two rotary halves interleaved (the inverse of what
    transformers' GGUF loader undoes)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _encode(data: np.ndarray, outtype: str):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if data.ndim == 1:
        return data, Q.F32
    if outtype == "f16" or (outtype == "q8_0" and data.shape[-1] % 32):
        return data.astype(np.float16), Q.F16
    kind = Q.BF16 if outtype == "bf16" else Q.Q8_0
    return quantize(data, kind), kind
