"""The two GGUF readers no one here wrote: transformers' GGUF loader and llama.cpp (through llama-cpp-python)."""

from __future__ import annotations

from pathlib import Path

import torch

from lcsb_cli.model.gguf import llama_cpp


def transformers_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


class LlamaCpp(llama_cpp.LlamaCpp):
    """A GGUF file loaded by llama.cpp through the project's helper (a child process, extra buffer types off), its
    logits as a torch tensor."""

    def logits(self, ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(super().logits(ids))


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
