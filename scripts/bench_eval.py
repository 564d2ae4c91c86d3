"""Score mode, old path against new, in one run: each prompt + tag as a whole row (the path before the shared prefix)
against one prompt pass and its KV cache (lcsb_cli.evaluate.labels.answer_logprobs), on the same model and questions.

    python scripts/bench_eval.py RECIPE [KEY=VALUE ...] [--questions N]

Prints seconds per path, the speedup, the largest score difference and whether every question picks the same tag.
"""

from __future__ import annotations

import argparse
import time

import torch

from lcsb_cli.backends import get_backend
from lcsb_cli.data import load_task
from lcsb_cli.data.batching import collate
from lcsb_cli.evaluate.labels import answer_logprobs, candidate_answers, prompt_ids
from lcsb_cli.model.load import inference_mode, load_model
from lcsb_cli.recipe import load_recipe


def whole_row_logprobs(model, prompts, answers, owners, pad_id, device) -> torch.Tensor:
    """The old path: every prompt + answer as its own right-padded row, one question's rows a forward."""
    return torch.cat(
        [
            _whole_rows(model, [(prompts[o], a) for o, a in zip(owners, answers) if o == q], pad_id, device)
            for q in range(len(prompts))
        ]
    )


def _whole_rows(model, pairs, pad_id, device) -> torch.Tensor:
    batch = collate([{"input_ids": p + a, "labels": [-100] * len(p) + a} for p, a in pairs], pad_id)
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
    targets = batch["labels"][:, 1:].to(device)
    answer = targets != -100
    picked = logits[:, :-1][answer].float().log_softmax(-1).gather(-1, targets[answer].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(answer.shape, device=device).masked_scatter(answer, picked).sum(-1).cpu()


def timed(path, model, batches, pad_id, device) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with inference_mode(model):
        scores = torch.cat(
            [path(model, prompts, answers, owners, pad_id, device) for prompts, answers, owners, _ in batches]
        )
    return time.perf_counter() - start, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--questions", type=int, default=0, help="the first N held-out questions (0: all)")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    backend = get_backend(recipe.backend, recipe.npu_sim)
    loaded = load_model(recipe, backend.device)
    backend.prepare(loaded)
    tokenizer, size = loaded.tokenizer, recipe.eval.batch_size
    questions = load_task(recipe, tokenizer).need_held_out()[: args.questions or None]
    # (prompts, answers, owners within the batch, owners among all questions)
    batches = []
    for start in range(0, len(questions), size):
        chunk = questions[start : start + size]
        answers, owners, _ = candidate_answers(tokenizer, chunk)
        batches.append(
            ([prompt_ids(tokenizer, q, recipe) for q in chunk], answers, owners, [start + o for o in owners])
        )
    owners = [o for batch in batches for o in batch[3]]
    # warm-up
    timed(answer_logprobs, loaded.model, batches[:1], tokenizer.pad_token_id, backend.device)
    old_s, old = timed(whole_row_logprobs, loaded.model, batches, tokenizer.pad_token_id, backend.device)
    new_s, new = timed(answer_logprobs, loaded.model, batches, tokenizer.pad_token_id, backend.device)
    same = all(
        max((i for i, o in enumerate(owners) if o == q), key=lambda i: old[i])
        == max((i for i, o in enumerate(owners) if o == q), key=lambda i: new[i])
        for q in range(len(questions))
    )
    print(f"{recipe.model.name}: {len(questions)} questions, {len(owners)} tag rows, eval batch {size}")
    print(f"whole rows (old) {old_s:.1f} s, shared prefix (new) {new_s:.1f} s: {old_s / new_s:.2f}x")
    print(f"max abs score difference {float((old - new).abs().max()):.2e}; same tag picked for every question: {same}")


if __name__ == "__main__":
    main()
