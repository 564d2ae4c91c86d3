"""A decoder layer's shape, read from a transformers config (Llama / Qwen2 / Mistral / Gemma names): what the npu-sim
CPU lane and the bench's roofline count their work from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> LayerShape:
        heads = config.num_attention_heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )
