"""Presets, local HF dirs and GGUF files -> model and tokenizer; quantization, streamed 4-bit build, LoRA,
chunked loss, memory settings and measurement; export (PEFT, merged HF, GGUF)."""
