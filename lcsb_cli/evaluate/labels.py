"""Classification (LaMP-2, labelled jsonl): predictions by tag likelihood or greedy decoding, metrics as LaMP
computes them."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence

import torch

from ..data.lamp2 import TAGS, LampQuestion, encode_example, retrieve_profile, split_input
from ..model.load import inference_mode
from ..recipe import Recipe

LOGITS_BUDGET_BYTES = 64 * 2**20


def lamp2_metrics(golds: Sequence[str], preds: Sequence[str], labels: Sequence[str] = TAGS) -> dict:
    """Accuracy and macro-F1 over all `labels`, as LaMP's evaluation (sklearn's f1 with labels=all, average=macro).

    Predictions are stripped; one that is not exactly a label counts wrong. A label with no gold and no
    prediction has F1 0, as sklearn's zero_division default gives.
    """
    preds = [p.strip() for p in preds]
    correct = [g == p for g, p in zip(golds, preds)]
    per_tag, f1s = {}, []
    for label in labels:
        tp = sum(c and g == label for c, g in zip(correct, golds))
        predicted, gold = preds.count(label), list(golds).count(label)
        f1 = 2 * tp / (predicted + gold) if predicted + gold else 0.0
        per_tag[label] = {"gold": gold, "predicted": predicted, "correct": tp, "f1": f1}
        f1s.append(f1)
    confusion = Counter((g, p) for g, p, c in zip(golds, preds, correct) if not c)
    return {
        "n": len(golds),
        "accuracy": sum(correct) / len(golds) if golds else 0.0,
        "macro_f1": sum(f1s) / len(f1s),
        "out_of_label": sum(p not in labels for p in preds),
        "per_tag": per_tag,
        "top_confusions": [{"gold": g, "predicted": p, "count": n} for (g, p), n in confusion.most_common(10)],
    }


def majority_accuracy(train_golds: Sequence[str], eval_golds: Sequence[str]) -> float:
    """Accuracy of always answering the most frequent training tag."""
    majority = Counter(train_golds).most_common(1)[0][0]
    return sum(g == majority for g in eval_golds) / len(eval_golds)


def predict(
    model, tokenizer, questions: Sequence[LampQuestion], recipe: Recipe, advance=lambda done: None
) -> list[str]:
    """Each question's tag (score or generate mode), eval.batch_size questions a pass; `advance(k)` after each."""
    predictor = score_tags if recipe.eval.mode == "score" else generate_tags
    device = next(model.parameters()).device
    preds: list[str] = []
    with inference_mode(model):
        for start in range(0, len(questions), recipe.eval.batch_size):
            chunk = questions[start : start + recipe.eval.batch_size]
            prompts = [prompt_ids(tokenizer, q, recipe) for q in chunk]
            preds += predictor(model, tokenizer, chunk, prompts, recipe, device)
            advance(len(chunk))
    return preds


def prompt_ids(tokenizer, question: LampQuestion, recipe: Recipe) -> list[int]:
    profile = retrieve_profile(question, recipe.data.profile_k)
    return encode_example(tokenizer, question.input, None, recipe.data.max_length, profile)["input_ids"]


def score_tags(model, tokenizer, questions, prompts, recipe, device) -> list[str]:
    """Each question's tag with the highest log P(" tag" + end-of-text | prompt).

    No length normalisation: the score is the probability of the whole answer, and the end-of-text token
    makes a tag and a longer tag that starts with it ("comedy", "comedy drama") compete fairly; averaging per
    token would favour long tags.
    """
    answers, owners, tags = candidate_answers(tokenizer, questions)
    scores = answer_logprobs(model, prompts, answers, owners, tokenizer.pad_token_id, device)
    best: dict[int, tuple[float, str]] = {}
    for owner, tag, score in zip(owners, tags, scores.tolist()):
        if owner not in best or score > best[owner][0]:
            best[owner] = (score, tag)
    return [best[i][1] for i in range(len(questions))]


def candidate_answers(tokenizer, questions) -> tuple[list[list[int]], list[int], list[str]]:
    """Every tag of each question's own list as answer tokens (" tag" + end-of-text), the question's index, the tag."""
    answers, owners, tags = [], [], []
    for index, question in enumerate(questions):
        for tag in split_input(question.input)[0]:
            answers.append(tokenizer(" " + tag, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            owners.append(index)
            tags.append(tag)
    return answers, owners, tags


def answer_logprobs(
    model, prompts: list[list[int]], answers: list[list[int]], owners: list[int], pad_id: int, device
) -> torch.Tensor:
    """Sum of log-probs of each answer after its prompt (`owners[i]` indexes prompts). Each prompt runs once,
    left-padded, keeping its KV cache and only its last position's logits; the answers then run from that cache,
    right-padded, as many at a time as keep their fp32 logits within LOGITS_BUDGET_BYTES (a 150k-token vocabulary
    makes the logits, not the model, what eval memory is spent on)."""
    from ..generate import left_padded

    ids, mask = left_padded(prompts, pad_id)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        use_cache=True,
        logits_to_keep=1,
    )
    prompt_pass = (out.logits[:, -1], out.cache, mask, positions)
    rows = max(1, LOGITS_BUDGET_BYTES // (max(map(len, answers)) * out.logits.shape[-1] * 4))
    return torch.cat(
        [
            _answers_from_cache(
                model,
                prompt_pass,
                answers[i : i + rows],
                owners[i : i + rows],
                pad_id,
                device,
                keep_cache=rows < len(answers),
            )
            for i in range(0, len(answers), rows)
        ]
    )


def _answers_from_cache(
    model, prompt_pass, answers: list[list[int]], owners: list[int], pad_id: int, device, keep_cache: bool
) -> torch.Tensor:
    last_logits, cache, mask, positions = prompt_pass
    owner = torch.tensor(owners)
    # the gather below is in place
    cache = copy.deepcopy(cache) if keep_cache else cache
    cache.batch_select_indices(owner.to(device))
    tail = max(map(len, answers))
    answer_ids = torch.full((len(answers), tail), pad_id, dtype=torch.long)
    answer_mask = torch.zeros_like(answer_ids)
    for i, answer in enumerate(answers):
        answer_ids[i, : len(answer)] = torch.tensor(answer)
        answer_mask[i, : len(answer)] = 1
    logits = model(
        input_ids=answer_ids.to(device),
        attention_mask=torch.cat([mask[owner], answer_mask], 1).to(device),
        position_ids=(positions[owner, -1:] + 1 + torch.arange(tail)).to(device),
        cache=cache,
        use_cache=True,
    ).logits
    # before each
    predicting = torch.cat([last_logits[owner.to(device)].unsqueeze(1), logits[:, :-1]], 1).float()
    picked = predicting.gather(-1, answer_ids.to(device).unsqueeze(-1)).squeeze(-1) - predicting.logsumexp(-1)
    return (picked * answer_mask.to(device)).sum(-1).cpu()


def generate_tags(model, tokenizer, questions, prompts, recipe, device) -> list[str]:
    """Greedy decoding, ended at the first newline (or an eval.stop string) and stripped, as LaMP's generation
    setting."""
    from ..generate import generate_texts

    return [
        text.strip()
        for text in generate_texts(
            model, tokenizer, prompts, recipe.eval.max_new_tokens, stop=["\n", *recipe.eval.stop]
        )
    ]
