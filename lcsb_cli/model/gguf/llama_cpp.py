"""llama.cpp (through llama-cpp-python), opened one way for the whole project.

Every model is opened with llama.cpp's extra buffer types off (`llama_model_params.use_extra_bufts = False`, what
llama.cpp's own `--no-repack` sets): on CPUs that report AMX, ggml puts quantized weights in its AMX buffer and its
tile instructions raise SIGILL in ggml's worker threads (ggml-org/llama.cpp#26954). That also turns off weight
repacking. `LlamaCpp` keeps the model in a child process, so a crash of llama.cpp is an exception naming the signal,
not a dead caller, and a hung call ends after `timeout_s`.
"""

from __future__ import annotations

import multiprocessing
import signal
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

UPSTREAM_ISSUE = "ggml-org/llama.cpp#26954"


class LlamaCppError(RuntimeError):
    """llama.cpp refused a request (a file it cannot load, an adapter that does not fit)."""


class LlamaCppCrashed(LlamaCppError):
    """The process running llama.cpp died or stopped answering."""


@contextmanager
def _without_extra_buffer_types():
    """llama-cpp-python's Llama takes its model parameters from `llama_model_default_params()` and offers no
    keyword for `use_extra_bufts`, so the defaults it reads are changed while a model opens."""
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def params():
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


def open_llama(path: Path, lora: Path | None = None, n_ctx: int = 512, logits_all: bool = True):
    """A llama_cpp.Llama on the GGUF file `path` (with the LoRA adapter GGUF `lora` at scale 1), in this process."""
    from llama_cpp import Llama

    lora_path = str(lora) if lora is not None else None
    with _without_extra_buffer_types():
        return Llama(
            str(path), lora_path=lora_path, n_ctx=n_ctx, logits_all=logits_all, n_threads=2, seed=0, verbose=False
        )


def tokenize(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def logits(llm, ids: list[int]) -> np.ndarray:
    """The logits at every position of `ids`, from an empty context."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def greedy(llm, ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy token ids after `ids`, with no stop token."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(new_tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def complete(llm, prompt: list[int], max_tokens: int, stop: list[str]) -> str:
    """llama.cpp's own greedy completion of the token ids `prompt`, as text."""
    return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stop=stop)["choices"][0]["text"]


OPERATIONS = {"tokenize": tokenize, "logits": logits, "greedy": greedy, "complete": complete}


def _serve(conn, path: Path, lora: Path | None, n_ctx: int) -> None:
    """The child: open the model, say so, then answer (operation, args) requests until None."""
    try:
        llm = open_llama(path, lora, n_ctx)
    except Exception as error:
        conn.send((False, f"{type(error).__name__}: {error}"))
        return
    conn.send((True, None))
    while (request := conn.recv()) is not None:
        operation, args = request
        try:
            conn.send((True, OPERATIONS[operation](llm, *args)))
        except Exception as error:
            conn.send((False, f"{type(error).__name__}: {error}"))
    llm.close()


class LlamaCpp:
    """A GGUF file (and optionally a LoRA adapter GGUF) loaded by llama.cpp in a child process.

    Each method runs the function of the same name above in the child. A child that dies raises LlamaCppCrashed
    naming its signal; one that does not answer in `timeout_s` is killed and raises it too.
    """

    def __init__(self, path: Path, lora: Path | None = None, n_ctx: int = 512, timeout_s: float = 600.0):
        self.pid = None
        self._what = f"llama.cpp on {Path(path).name}" + (f" with {Path(lora).name}" if lora is not None else "")
        self._timeout_s = timeout_s
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, Path(path), lora, n_ctx), daemon=True)
        self._process.start()
        child_end.close()
        self.pid = self._process.pid
        self._answer()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str) -> list[int]:
        return self._ask("tokenize", text)

    def logits(self, ids: list[int]) -> np.ndarray:
        return self._ask("logits", ids)

    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        return self._ask("greedy", ids, new_tokens)

    def complete(self, prompt: list[int], max_tokens: int = 8, stop: tuple[str, ...] = ("\n",)) -> str:
        return self._ask("complete", prompt, max_tokens, list(stop))

    def close(self) -> None:
        if self._process.is_alive():
            with suppress(OSError):
                self._conn.send(None)
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _ask(self, operation: str, *args):
        try:
            self._conn.send((operation, args))
        except OSError:
            raise self._crashed() from None
        return self._answer()

    def _answer(self):
        if not self._conn.poll(self._timeout_s):
            self._process.kill()
            self._process.join()
            raise LlamaCppCrashed(f"{self._what}: no answer in {self._timeout_s:.0f} s; the process was killed")
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._crashed() from None
        if not ok:
            raise LlamaCppError(f"{self._what}: {value}")
        return value

    def _crashed(self) -> LlamaCppCrashed:
        self._process.join(10)
        code = self._process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = f" (llama.cpp's AMX kernels on this CPU? see {UPSTREAM_ISSUE})" if name == "SIGILL" else ""
            return LlamaCppCrashed(f"{self._what}: the process died of {name}{hint}")
        return LlamaCppCrashed(f"{self._what}: the process ended with exit code {code}")
