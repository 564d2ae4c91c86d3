"""GGUF files: read, converted, trained as packed blocks, written; llama.cpp opened."""
