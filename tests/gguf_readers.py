"""The two GGUF readers no one here wrote: transformers' GGUF loader and llama.cpp (through llama-cpp-python)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def transformers_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


class LlamaCpp:
    """A GGUF file loaded by llama.cpp: tokenizer, logits for a token sequence, greedy continuation."""

    def __init__(self, path: Path, n_ctx: int = 512):
        from llama_cpp import Llama

        self.llm = Llama(str(path), logits_all=True, verbose=False, n_ctx=n_ctx, n_threads=2, seed=0)

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.llm.close()

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.tensor(np.array(self.llm.scores[: len(ids)]))

    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for _ in range(new_tokens):
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            self.llm.eval(out[-1:])
        return out


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            min_new_tokens=new_tokens,
        )
    return out[0, len(ids) :].tolist()
