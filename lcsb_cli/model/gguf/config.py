"""The config a GGUF file's model needs, completed where transformers' map from GGUF metadata stops short.

transformers builds a config from a GGUF file's metadata with one table of keys per architecture; a key it does not
read falls back to the config class's default, which is one checkpoint's value. llama.cpp reads those keys, so a
file can run right in llama.cpp and wrong, or not at all, in transformers: Qwen3's head size (default 128), Phi-3's
partial rotation, Gemma 3's attention scale, and every rotary scaling (Llama 3's frequency factors, Phi-3's LongRoPE
factors, Gemma 3's linear scaling). `config_overrides` gives those values as llama.cpp reads the file, for the
architectures checked here, and refuses in one line what transformers' model of the architecture cannot hold.
"""

from __future__ import annotations

from ...errors import BadInput

# the GGUF architectures whose transformers config was checked against what llama.cpp reads from the metadata
# (mistral files are llama); of those, the ones whose config takes head_dim (the others compute hidden_size / heads)
# and the ones whose model rotates part of each head (rope_parameters' partial_rotary_factor)
CHECKED = {"llama", "qwen2", "qwen3", "phi3", "gemma3"}
HEAD_DIM_IN_CONFIG = {"llama", "qwen3", "gemma3"}
PARTIAL_ROTARY = {"phi3"}
# ... and those whose config holds LongRoPE's original context outside rope_parameters (and puts it in from there)
ORIGINAL_CONTEXT_IN_CONFIG = {"phi3"}
# Gemma 3 27B (62 layers) scales attention by hidden_size / heads, every other size by the head size (llama.cpp)
GEMMA3_27B_LAYERS = 62
# llama.cpp's fixed rotary base of Gemma 3's sliding-window layers (transformers' default too)
GEMMA3_SLIDING_THETA = 10000.0


def config_overrides(fields: dict, tensors: dict) -> dict:
    """Config keyword arguments for transformers' `from_pretrained(gguf_file=...)`: what its GGUF map does not read
    from this file's metadata (`fields`: GgufIndex's scalars) and tensors (`tensors`: GgufIndex's entries by name),
    as llama.cpp reads them. Architectures not in CHECKED keep transformers' own reading."""
    arch = fields["general.architecture"]

    def key(name: str, default=None):
        return fields.get(f"{arch}.{name}", default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    # per-layer head counts (an array, skipped by the index) or none: transformers' own map decides
    if arch not in CHECKED or not isinstance(heads, int) or not heads or not hidden:
        return {}
    head_dim = key("attention.key_length") or hidden // heads
    if key("attention.value_length", head_dim) != head_dim:
        raise _cannot_hold(
            arch, f"its values have {key('attention.value_length')} dimensions a head, its keys {head_dim}"
        )
    overrides = {}
    if arch in HEAD_DIM_IN_CONFIG:
        overrides["head_dim"] = head_dim
    elif head_dim != hidden // heads:
        raise _cannot_hold(arch, f"its heads have {head_dim} dimensions, not hidden size / heads")
    rope = _rope(arch, key, tensors, head_dim)
    if rope is not None:
        overrides["rope_parameters"] = rope
        if arch in ORIGINAL_CONTEXT_IN_CONFIG and "original_max_position_embeddings" in rope:
            overrides["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if arch == "gemma3":
        overrides["query_pre_attn_scalar"] = hidden // heads if key("block_count") == GEMMA3_27B_LAYERS else head_dim
    return overrides


def _rope(arch: str, key, tensors: dict, head_dim: int) -> dict | None:
    """transformers' rope_parameters for the rotation llama.cpp applies, or None where transformers' map already
    reads it all (the base frequency). llama.cpp divides each frequency by a factor read from the file (Llama 3's
    `rope_freqs`, Phi-3's `rope_factors_short` / `_long`): transformers' LongRoPE form."""
    rope = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    rotary = key("rope.dimension_count") or head_dim
    if rotary != head_dim:
        if arch not in PARTIAL_ROTARY:
            raise _cannot_hold(arch, f"it rotates {rotary} of each head's {head_dim} dimensions")
        rope["partial_rotary_factor"] = rotary / head_dim
    scaling = key("rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        factors = _factors(tensors, "rope_freqs.weight")
        context = key("context_length")
        rope.update(rope_type="longrope", short_factor=factors, long_factor=factors, factor=1.0, attention_factor=1.0)
        rope["original_max_position_embeddings"] = context
    elif "rope_factors_long.weight" in tensors:
        rope.update(
            rope_type="longrope",
            short_factor=_factors(tensors, "rope_factors_short.weight"),
            long_factor=_factors(tensors, "rope_factors_long.weight"),
            original_max_position_embeddings=key("rope.scaling.original_context_length"),
        )
        if key("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = key("rope.scaling.attn_factor")
    elif scaling == "linear":
        rope.update(rope_type="linear", factor=key("rope.scaling.factor"))
    elif scaling != "none":
        raise _cannot_hold(arch, f"lcsb does not read its rope scaling {scaling!r}")
    if rope == {"rope_type": "default", "rope_theta": rope["rope_theta"]}:
        return None
    if arch == "gemma3":
        # only the global layers scale; llama.cpp keeps the sliding layers' base frequency fixed
        return {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_SLIDING_THETA},
        }
    return rope


def _factors(tensors: dict, name: str) -> list[float]:
    return [float(value) for value in tensors[name].data.reshape(-1)]


def _cannot_hold(arch: str, why: str) -> BadInput:
    return BadInput(f"model.name: transformers' {arch} model cannot hold this GGUF file: {why}")
