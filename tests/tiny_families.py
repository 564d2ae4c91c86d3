"""Random-init checkpoints of other families in the tiny preset's shape and with its tokenizer: Llama (q/k rows
permuted in GGUF) and Phi-3 (fused qkv_proj and gate_up_proj)."""

from __future__ import annotations

from pathlib import Path

import torch

from lcsb_cli.model import load as models

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def tiny_model(arch: str):
    """The tiny preset's Qwen2 model, or a random `arch` model (llama | phi3) of its shape, GQA and tied head."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models.resolve_base_dir("tiny-qwen2"), dtype=torch.float32)
    if arch == "qwen2":
        return model
    shape = {key: getattr(model.config, key) for key in (*SHAPE_KEYS, "num_key_value_heads", "tie_word_embeddings")}
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=2048, rope_theta=10000.0))
    # Phi3Config's token ids default to Phi-3's 32k vocabulary
    ids = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    return Phi3ForCausalLM(Phi3Config(**shape, **ids, max_position_embeddings=2048, rope_theta=10000.0))


def tiny_checkpoint(path: Path, arch: str) -> Path:
    """`tiny_model(arch)` saved as an HF checkpoint dir with the tiny preset's tokenizer."""
    tiny_model(arch).save_pretrained(path)
    models.load_tokenizer(models.resolve_base_dir("tiny-qwen2")).save_pretrained(path)
    return path
