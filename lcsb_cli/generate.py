"""Decoding with the KV cache: batches of left-padded prompts in, each prompt's new tokens out; `lcsb generate`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import BadInput
from .model.load import inference_mode
from .recipe import Recipe


def generate_ids(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    streamer=None,
    stop: Sequence[str] = (),
) -> list[list[int]]:
    """Each prompt's new tokens, cut before the first stop token (`stop_ids`); a row also ends once its text
    holds a `stop` string (those tokens are kept: `generate_texts` cuts the text).

    Prompts are left-padded so every row's next token sits at the last position; transformers derives the position
    ids from the attention mask. temperature 0 is greedy; above 0 samples under `seed` in a forked RNG, so the
    caller's random state is untouched. A `streamer` takes one prompt at a time.
    """
    if not prompts:
        return []
    if not all(prompts):
        raise BadInput("a prompt is empty: give at least one token of text")
    stops = stop_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer)
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_id)
    with seeded_inference(model, seed):
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            **decoding_kwargs(model, tokenizer, temperature, stop),
        )
    # a row that a stop string ended is padded from there on
    ends = [*stops, pad_id] if stop else stops
    return [until_stop(row, ends) for row in out[:, ids.shape[1] :].tolist()]


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def decoding_kwargs(model, tokenizer, temperature: float, stop: Sequence[str]) -> dict:
    """model.generate's arguments for how to decode: greedy at temperature 0, else sampled; the stop ids (eos), the
    pad id and the stop strings."""
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if stop:
        sampling.update(stop_strings=list(stop), tokenizer=tokenizer)
    stops = stop_ids(model, tokenizer)
    return {"use_cache": True, "eos_token_id": stops or None, "pad_token_id": pad_token_id(tokenizer), **sampling}


@contextlib.contextmanager
def seeded_inference(model, seed: int):
    """inference_mode, with the RNG forked and seeded (the caller's random state is untouched)."""
    device = next(model.parameters()).device
    forked = [device] if device.type == "cuda" else []
    with inference_mode(model), torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        yield


def generate_texts(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    streamer=None,
    stop: Sequence[str] = (),
) -> list[str]:
    """Each prompt's new text, ended before its first `stop` string."""
    new = generate_ids(model, tokenizer, prompts, max_new_tokens, temperature, seed, streamer, stop)
    return [cut_at_stop(text, stop) for text in tokenizer.batch_decode(new, skip_special_tokens=True)]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    return text[: min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))]


def text_streamer(tokenizer, stop: Sequence[str] = ()):
    """transformers' TextStreamer for one prompt's new text that never prints a `stop` string: it holds back as many
    characters as a stop string could still be completing, and ends the line at the first stop."""
    from transformers import TextStreamer

    class StopStreamer(TextStreamer):
        held, stopped = "", False

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if self.stopped:
                return
            self.held += text
            cut = cut_at_stop(self.held, stop)
            self.stopped = len(cut) < len(self.held)
            if stream_end or self.stopped:
                super().on_finalized_text(cut, stream_end=True)
                self.held = ""
                return
            ready = len(self.held) - max((len(s) - 1 for s in stop), default=0)
            if ready > 0:
                super().on_finalized_text(self.held[:ready])
                self.held = self.held[ready:]

    return StopStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def stop_ids(model, tokenizer) -> list[int]:
    """The tokenizer's eos and the model's generation_config eos ids (SmolLM2's chat ends a turn with <|im_end|>)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *configured] if i is not None))


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def until_stop(tokens: list[int], stops: list[int]) -> list[int]:
    cut = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
    return tokens[:cut]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation in the tokenizer's chat template, ending with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(
            f"{tokenizer.name_or_path}: the tokenizer has no chat template; use a chat (instruct) model, "
            "or give plain prompts without --chat"
        )
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def prompt_ids(tokenizer, item: str | list[dict], chat: bool) -> list[int]:
    """A text prompt (with `chat`: the user's message) or a list of chat messages, as token ids."""
    if not chat:
        return tokenizer(item)["input_ids"]
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": item}] if isinstance(item, str) else item)


def read_inputs(path: Path, chat: bool) -> list[str | list[dict]]:
    """--file's JSONL: {"prompt": TEXT} lines and, with `chat`, {"messages": [{"role", "content"}, ...]} lines."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"--file: {path} cannot be read as UTF-8 text ({type(exc).__name__})") from exc
    inputs = [_input(line, chat, f"{path}: line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not inputs:
        raise BadInput(f"--file: {path} holds no prompts")
    return inputs


def _input(line: str, chat: bool, where: str) -> str | list[dict]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{where}: not valid JSON ({exc.msg})") from exc
    if chat and isinstance(item, dict) and _is_conversation(item.get("messages")):
        return item["messages"]
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"]
    wanted = (
        '{"prompt": TEXT} or {"messages": [{"role": ..., "content": ...}, ...]}'
        if chat
        else '{"prompt": TEXT} (messages need --chat)'
    )
    raise BadInput(f"{where}: expected {wanted}")


def _is_conversation(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


@dataclass(frozen=True)
class Sampling:
    """How `lcsb generate` decodes: at most `max_new_tokens`, greedy at temperature 0 or sampled with `seed`,
    each text ended before the first of `stop`."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()


def run_generate(
    recipe: Recipe, adapter: Path | None, inputs: list[str | list[dict]], chat: bool, sampling: Sampling
) -> list[str]:
    """Load the model once, then stream each input's generation to stdout, one prompt at a time; the texts."""
    loaded = load_for_decoding(recipe, adapter)
    prompts = [prompt_ids(loaded.tokenizer, item, chat) for item in inputs]
    texts = []
    for prompt in prompts:
        streamer = text_streamer(loaded.tokenizer, sampling.stop)
        texts += generate_texts(
            loaded.model,
            loaded.tokenizer,
            [prompt],
            sampling.max_new_tokens,
            sampling.temperature,
            sampling.seed,
            streamer,
            sampling.stop,
        )
    return texts


def load_for_decoding(recipe: Recipe, adapter: Path | None):
    """The recipe's model (with `adapter`'s LoRA weights) on its backend, ready to decode."""
    from .backends import get_backend
    from .model.load import load_model

    backend = get_backend(recipe.backend, recipe.npu_sim)
    loaded = load_model(recipe, backend.device, adapter)
    backend.prepare(loaded)
    return loaded
