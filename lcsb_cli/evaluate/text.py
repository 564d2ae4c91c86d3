"""Held-out loss and perplexity (every format), and generated answers scored by exact match and ROUGE-1 / ROUGE-L
(completion, chat) as LaMP-4..7 score theirs: mean F-measure of `rouge-score`, no stemming (the defaults of the
`evaluate` library's rouge that LaMP's scripts call)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..data.batching import collate
from ..model.load import inference_mode
from ..model.losses import causal_lm_loss


def held_out_loss(model, rows: Sequence[dict], pad_id: int, batch_size: int, advance=lambda done: None) -> dict:
    """Mean NLL per target token over all rows (labels != -100), and its exp; `advance(k)` after each batch."""
    total, tokens = 0.0, 0
    device = next(model.parameters()).device
    with inference_mode(model):
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(list(rows[start : start + batch_size]), pad_id).items()}
            total += causal_lm_loss(model, batch).item()
            tokens += int((batch["labels"][:, 1:] != -100).sum())
            advance(len(batch["labels"]))
    loss = total / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "target_tokens": tokens}


def text_metrics(references: Sequence[str], outputs: Sequence[str]) -> dict:
    """Exact match (after strip) and mean ROUGE-1 / ROUGE-L F-measure."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=False)
    scores = [scorer.score(ref, out) for ref, out in zip(references, outputs)]
    n = len(references)
    return {
        "n": n,
        "exact_match": sum(r.strip() == o.strip() for r, o in zip(references, outputs)) / n if n else 0.0,
        "rouge1": sum(s["rouge1"].fmeasure for s in scores) / n if n else 0.0,
        "rougeL": sum(s["rougeL"].fmeasure for s in scores) / n if n else 0.0,
    }


def generate_answers(
    model,
    tokenizer,
    rows: Sequence[dict],
    max_new_tokens: int,
    batch_size: int,
    stop: Sequence[str] = (),
    advance=lambda done: None,
) -> list[str]:
    """Greedy answers to each row's prompt, ended before a `stop` string, stripped; `advance(k)` after each batch."""
    from ..generate import generate_texts

    outputs: list[str] = []
    for start in range(0, len(rows), batch_size):
        prompts = [row["prompt_ids"] for row in rows[start : start + batch_size]]
        outputs += [text.strip() for text in generate_texts(model, tokenizer, prompts, max_new_tokens, stop=stop)]
        advance(len(prompts))
    return outputs
