"""`lcsb chat`: a multi-turn conversation over one KV cache, streamed, with /reset, /system and /exit.

Each turn renders the whole conversation with the chat template and feeds the model only what its cache does not
hold yet: the cache keeps the longest prefix it shares with the new prompt (the turns so far, the last reply) and
the rest (the end of the last reply's turn, the new user turn, the template's glue) is all a turn pays for.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from .errors import BadInput
from .generate import (
    Sampling,
    chat_prompt_ids,
    cut_at_stop,
    decoding_kwargs,
    load_for_decoding,
    seeded_inference,
    stop_ids,
    until_stop,
)
from .model.load import preset_names
from .paths import recipe_file
from .recipe import Recipe, replace_key
from .rundir import resolve_target

# lcsb's own plain chat layout (the lcsb-bpe tokenizer's, which the chat data format trains the tiny presets with),
# each turn ended by the tokenizer's own eos: for a base whose tokenizer has no chat template
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HELP = "/reset clears the conversation, /system TEXT sets the system message, /exit or Ctrl-D leaves"
PROMPT = "> "


@dataclass
class Turn:
    """One exchange: the prompt the model answered (the whole conversation, as token ids), how many of its tokens
    the cache already held, and the reply."""

    prompt_ids: list[int]
    reused: int
    reply: str
    new_tokens: int
    # end of turn (eos) | stop (a stop string) | max_new_tokens | interrupted (Ctrl-C)
    ended: str


class Interrupt(StoppingCriteria):
    """Ctrl-C while a reply streams: the reply ends after its current token and the session goes on."""

    hit = False

    @contextlib.contextmanager
    def armed(self):
        self.hit = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.hit, dtype=torch.bool, device=input_ids.device)


class ReplyStreamer:
    """transformers' streamer protocol: writes a reply's text as its tokens come, holding back an unfinished
    character and what could be the start of a stop string, and never writing a stop string."""

    def __init__(self, tokenizer, write, stop: tuple[str, ...] = ()):
        self.tokenizer, self.write, self.stop = tokenizer, write, stop
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = self.stopped = False

    def put(self, value) -> None:
        # generate hands over the prompt first
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids += value.reshape(-1).tolist()
        self._show(final=False)

    def end(self) -> None:
        self._show(final=True)

    def _show(self, final: bool) -> None:
        if self.stopped:
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        ready = cut_at_stop(text, self.stop)
        self.stopped = len(ready) < len(text)
        if not (final or self.stopped):
            ready = ready[: len(ready) - max((len(s) - 1 for s in self.stop), default=0)].rstrip("\ufffd")
        if len(ready) > self.shown:
            self.write(ready[self.shown :])
            self.shown = len(ready)


class Conversation:
    """The messages so far and a KV cache holding the tokens of the conversation the model has seen."""

    def __init__(self, model, tokenizer, sampling: Sampling):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.system: str | None = None
        self.interrupt = Interrupt()
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = DynamicCache(config=self.model.config)
        # the tokens whose keys and values the cache holds
        self.cached: list[int] = []
        self.turns = 0

    def set_system(self, text: str | None) -> None:
        """A new system message (None: none); the conversation starts over. A template that refuses a system
        message is BadInput, and nothing changes."""
        if text:
            try:
                chat_prompt_ids(self.tokenizer, [{"role": "system", "content": text}, {"role": "user", "content": "."}])
            except Exception as exc:
                raise BadInput(f"the chat template refuses a system message ({exc})") from exc
        self.system = text or None
        self.reset()

    def say(self, text: str, streamer=None) -> Turn:
        """The user's turn in, the model's reply streamed out and kept in the conversation (an interrupted reply as
        far as it got)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = chat_prompt_ids(self.tokenizer, messages)
        reused = self._keep_prefix(prompt)
        with self.interrupt.armed():
            new = self._decode(prompt, streamer)
        reply_ids = until_stop(new, stop_ids(self.model, self.tokenizer))
        full = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        reply = cut_at_stop(full, self.sampling.stop)
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        self.turns += 1
        return Turn(prompt, reused, reply, len(new), self._ending(new, reply_ids, full, reply))

    def _keep_prefix(self, prompt: list[int]) -> int:
        """Crop the cache to what it shares with `prompt` (at least one prompt token left to feed); its length."""
        keep = 0
        limit = min(len(self.cached), len(prompt) - 1)
        while keep < limit and self.cached[keep] == prompt[keep]:
            keep += 1
        if keep < len(self.cached):
            if self.cache.is_croppable:
                self.cache.crop(keep - len(self.cached))
            else:
                self.cache, keep = DynamicCache(config=self.model.config), 0
        self.cached = self.cached[:keep]
        return keep

    def _decode(self, prompt: list[int], streamer) -> list[int]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt], device=device)
        with seeded_inference(self.model, self.sampling.seed + self.turns):
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                cache=self.cache,
                max_new_tokens=self.sampling.max_new_tokens,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([self.interrupt]),
                **decoding_kwargs(self.model, self.tokenizer, self.sampling.temperature, self.sampling.stop),
            )
        sequence = out[0].tolist()
        # the last token generated is never fed back, so the cache holds one less
        self.cached = sequence[: self.cache.get_seq_length()]
        return sequence[len(prompt) :]

    def _ending(self, new: list[int], reply_ids: list[int], full: str, reply: str) -> str:
        if self.interrupt.hit:
            return "interrupted"
        if len(reply_ids) < len(new):
            return "end of turn"
        if len(reply) < len(full):
            return "stop"
        return "max_new_tokens"


class Repl:
    """Reads user turns (a prompt with line editing on a TTY; one line each from a pipe), answers commands, and
    streams each reply to `out`; status lines go to `note`. With `transcript`, each turn appends a JSON line."""

    def __init__(self, conversation: Conversation, stdin, out, note, transcript: Path | None = None):
        self.conversation, self.stdin, self.out, self.note = conversation, stdin, out, note
        self.transcript = transcript
        self.tty = stdin.isatty()

    def run(self) -> None:
        for line in self._lines():
            if not self._answer(line.strip()):
                return

    def _lines(self):
        if not self.tty:
            yield from (line.rstrip("\r\n") for line in self.stdin)
            return
        # line editing and history for input()
        import readline  # noqa: F401

        while True:
            try:
                yield input(PROMPT)
            except EOFError:
                self._write("\n")
                return
            except KeyboardInterrupt:
                self._write("\n")
                self.note("(Ctrl-D or /exit leaves)")

    def _answer(self, text: str) -> bool:
        """Handle one line; False to leave."""
        if not text:
            return True
        if text.startswith("/"):
            return self._command(text)
        streamer = ReplyStreamer(self.conversation.tokenizer, self._write, self.conversation.sampling.stop)
        turn = self.conversation.say(text, streamer)
        self._write("\n")
        if turn.ended == "interrupted":
            self.note("[reply stopped]")
        elif turn.ended == "max_new_tokens" and self.tty:
            self.note(f"[reply cut at --max-new-tokens {self.conversation.sampling.max_new_tokens}]")
        self._record(text, turn)
        return True

    def _command(self, text: str) -> bool:
        name, _, rest = text.partition(" ")
        if name == "/exit":
            return False
        if name == "/reset":
            self.conversation.reset()
            self.note("[conversation cleared]")
        elif name == "/system":
            try:
                self.conversation.set_system(rest.strip())
            except BadInput as exc:
                self.note(f"error: {exc}")
                return True
            self.note("[system message set; conversation cleared]" if rest.strip() else "[no system message]")
        else:
            self.note(f"unknown command {name}: {HELP}")
        return True

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _record(self, user: str, turn: Turn) -> None:
        if self.transcript is None:
            return
        row = {
            "turn": self.conversation.turns,
            "user": user,
            "prompt": self.conversation.tokenizer.decode(turn.prompt_ids),
            "prompt_ids": turn.prompt_ids,
            "reused_tokens": turn.reused,
            "fed_tokens": len(turn.prompt_ids) - turn.reused,
            "reply": turn.reply,
            "new_tokens": turn.new_tokens,
            "ended": turn.ended,
        }
        with self.transcript.open("a", encoding="utf-8") as file:
            file.write(json.dumps(row) + "\n")


def chat_target(
    target: str, overrides: list[str], adapter: Path | None, user: str | None
) -> tuple[Recipe, Path | None]:
    """(recipe, adapter) of chat's TARGET: a run dir (its adapter/, or adapters/USER/), a model dir, a built-in preset
    or a .gguf file (the default recipe on it), or a recipe (its base, or --adapter)."""
    path = Path(target)
    if not path.is_dir() and (target in preset_names() or (path.suffix == ".gguf" and path.is_file())):
        if user is not None:
            raise BadInput("--user: picks a user's adapter in a per-user run dir; give the run dir")
        if overrides:
            raise BadInput(
                f"{target}: a preset or .gguf file takes no KEY=VALUE overrides; give a recipe and "
                f"model.name={target} with them instead"
            )
        name = target if target in preset_names() else str(path.resolve())
        return replace_key(Recipe(name=path.stem), "model.name", name), adapter
    if not path.exists() and not recipe_file(target).is_file():
        raise BadInput(
            f"{target}: not found; give a run dir, a model dir, a built-in preset ({', '.join(preset_names())}), "
            "a .gguf file or a recipe"
        )
    recipe, adapter, run_dir = resolve_target(target, overrides, adapter, user, model_dir_ok=True)
    if run_dir is not None and adapter is None:
        raise BadInput(f"{run_dir}: a per-user run has one adapter per user; pass --user ID")
    return recipe, adapter


def check_transcript(path: Path | None) -> None:
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise BadInput(f"--transcript: {path} is a directory or its folder does not exist; give a file path")


def run_chat(recipe: Recipe, adapter: Path | None, sampling: Sampling, transcript: Path | None = None) -> None:
    """Load the model once, then talk: stdin's turns in, replies streamed to stdout, status lines on stderr."""
    check_transcript(transcript)
    loaded = load_for_decoding(recipe, adapter)
    tokenizer = loaded.tokenizer
    note = _note_to(sys.stderr)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_TEMPLATE
        note("(the model has no chat template: lcsb's plain layout, <|role|> lines ended by its eos)")
    conversation = Conversation(loaded.model, tokenizer, sampling)
    if sys.stdin.isatty():
        what = recipe.model.name + (f" + {adapter}" if adapter else "")
        note(f"chatting with {what}; {HELP}; Ctrl-C stops a reply")
    Repl(conversation, sys.stdin, sys.stdout, note, transcript).run()


def _note_to(stream):
    def note(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return note
