"""A LaMP-2 adapter exported as a LoRA GGUF, run where users run it: llama.cpp (llama-cpp-python) on the base's own
GGUF file with `lora_path`, answering the held-out questions greedily, with and without the adapter, scored as
LaMP scores them (exact tag after strip). The prompts are lcsb's own token ids (`evaluate/labels.prompt_ids`), so
the numbers sit beside `lcsb eval RUN eval.mode=generate`.

    lcsb export runs/pooled --format gguf -o pooled.gguf
    python scripts/llama_cpp_lamp2.py runs/pooled pooled.gguf --limit 30
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lcsb_cli.data import TAGS, load_task
from lcsb_cli.evaluate.labels import prompt_ids
from lcsb_cli.model.llama_cpp import LlamaCpp
from lcsb_cli.model.load import gguf_source, load_tokenizer, resolve_base_dir
from lcsb_cli.run.rundir import finished_run


def answers(model_path: Path, lora: Path | None, prompts: list[list[int]]) -> list[str]:
    with LlamaCpp(model_path, lora, n_ctx=1024) as llm:
        return [llm.complete(prompt).strip() for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("adapter_gguf", type=Path)
    parser.add_argument("--limit", type=int, default=30)
    args = parser.parse_args()
    recipe, _ = finished_run(args.run, None)
    tokenizer = load_tokenizer(resolve_base_dir(recipe.model.name, recipe.model.dtype))
    task = load_task(recipe, tokenizer)
    questions = task.held_out[: args.limit]
    prompts = [prompt_ids(tokenizer, question, recipe) for question in questions]
    golds = [question.output for question in questions]
    base = gguf_source(recipe.model.name)
    for name, lora in (("base", None), ("base + adapter", args.adapter_gguf)):
        said = answers(base, lora, prompts)
        accuracy = sum(a == g for a, g in zip(said, golds)) / len(golds)
        in_label = sum(a in TAGS for a in said) / len(said)
        print(f"llama.cpp {name}: accuracy {accuracy:.3f} on {len(golds)} questions, tag answers {in_label:.3f}")


if __name__ == "__main__":
    main()
