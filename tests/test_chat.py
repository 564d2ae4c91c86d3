"""`lcsb chat`: turns over one KV cache equal uncached decoding of the whole conversation, a turn feeds only its new
tokens, Ctrl-C stops a reply and not the session; the REPL in a real pseudo-terminal and from a pipe; bad input."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_one_line_error, cli, run_train

from lcsb_cli.chat import PLAIN_TEMPLATE, Conversation, ReplyStreamer, chat_target
from lcsb_cli.generate import Sampling, generate_texts, load_for_decoding
from lcsb_cli.model.load import load_tokenizer

# one worker trains the module's run once
pytestmark = pytest.mark.xdist_group("chat")

LAMP_TINY = REPO / "configs" / "models" / "lamp-tiny"
FIRST, SECOND, THIRD = "Which tag fits a film about a heist?", "And a film about a dog?", "Tell me about Jonah."


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A LaMP-2 run on the pretrained lamp-tiny base (it answers in words), a per-user copy of its config, and a
    model dir without a chat template."""
    root = tmp_path_factory.mktemp("chat")
    run_train(root / "run", "model.name=lamp-tiny", "train.max_steps=2", "train.save_every=0", "train.warmup_steps=0")
    (root / "per_user").mkdir()
    config = (root / "run" / "config.yaml").read_text()
    assert "\n  user: null\n" in config
    (root / "per_user" / "config.yaml").write_text(config.replace("\n  user: null\n", "\n  user: all\n"))
    plain = root / "plain"
    shutil.copytree(LAMP_TINY, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root


@pytest.fixture(scope="module")
def loaded(world):
    recipe, adapter = chat_target(str(world / "run"), [], None, None)
    assert adapter == world / "run" / "adapter"
    return load_for_decoding(recipe, adapter)


def fed_lengths(model):
    """A forward pre-hook that records how many tokens each forward of the causal LM is fed."""
    lengths = []

    def hook(module, args, kwargs):
        lengths.append(kwargs["input_ids"].shape[1])

    return lengths, model.get_base_model().register_forward_pre_hook(hook, with_kwargs=True)


def test_a_turn_feeds_only_its_new_tokens_and_answers_as_uncached_decoding(loaded):
    conversation = Conversation(loaded.model, loaded.tokenizer, Sampling(max_new_tokens=24))
    lengths, handle = fed_lengths(loaded.model)
    try:
        first = conversation.say(FIRST)
        first_fed, lengths[:] = list(lengths), []
        second = conversation.say(SECOND)
    finally:
        handle.remove()

    assert first.reused == 0 and first_fed[0] == len(first.prompt_ids)
    # the second prompt holds the first turn: its prompt, the tokens of the reply, then the new user turn
    reply_ids = loaded.tokenizer(first.reply, add_special_tokens=False)["input_ids"]
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert second.prompt_ids[len(first.prompt_ids) :][: len(reply_ids)] == reply_ids
    assert first.reply and first.reply in loaded.tokenizer.decode(second.prompt_ids)
    # the cache held all of it but the reply's last token: only that token and the new turn were fed
    assert second.reused == len(first.prompt_ids) + first.new_tokens - 1
    assert lengths[0] == len(second.prompt_ids) - second.reused
    fed = loaded.tokenizer.decode(second.prompt_ids[second.reused :])
    glue = f"<|endoftext|>\n<|user|>\n{SECOND}<|endoftext|>\n<|assistant|>\n"
    assert fed.endswith(glue) and first.reply.endswith(fed[: -len(glue)]) and len(fed) - len(glue) < 10
    # one token per forward after that
    assert set(lengths[1:]) == {1}
    for turn in (first, second):
        assert [turn.reply] == generate_texts(loaded.model, loaded.tokenizer, [turn.prompt_ids], 24)


def test_reset_and_system_start_over(loaded):
    conversation = Conversation(loaded.model, loaded.tokenizer, Sampling(max_new_tokens=8))
    alone = conversation.say(SECOND)
    conversation.say(FIRST)
    conversation.reset()
    again = conversation.say(SECOND)
    assert again.prompt_ids == alone.prompt_ids and again.reused == 0 and again.reply == alone.reply

    conversation.set_system("Answer with one tag.")
    with_system = conversation.say(SECOND)
    text = loaded.tokenizer.decode(with_system.prompt_ids)
    assert text.startswith("<|system|>\nAnswer with one tag.") and FIRST not in text
    assert with_system.reused == 0


def test_an_interrupted_reply_stops_early_and_the_conversation_goes_on(loaded):
    """SIGINT (Ctrl-C) while a reply streams: that reply ends, is kept as far as it got, and the next turn is
    answered from a cache that holds it."""
    sampling = Sampling(max_new_tokens=200)
    conversation = Conversation(loaded.model, loaded.tokenizer, sampling)
    shown = []

    def write(text):
        shown.append(text)
        if len(shown) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    stopped = conversation.say(THIRD, ReplyStreamer(loaded.tokenizer, write))
    assert stopped.ended == "interrupted" and 3 <= stopped.new_tokens < 20
    assert "".join(shown) == stopped.reply
    # the handler was put back
    assert signal.getsignal(signal.SIGINT) is handler

    conversation.sampling = Sampling(max_new_tokens=12)
    after = conversation.say(FIRST)
    assert stopped.reply in loaded.tokenizer.decode(after.prompt_ids)
    assert after.reused == len(stopped.prompt_ids) + stopped.new_tokens - 1
    assert [after.reply] == generate_texts(loaded.model, loaded.tokenizer, [after.prompt_ids], 12)


def test_the_streamer_holds_back_stop_strings_and_unfinished_characters(loaded):
    tokenizer = loaded.tokenizer
    ids = tokenizer("a drama — very STOP sad", add_special_tokens=False)["input_ids"]
    chunks = []
    streamer = ReplyStreamer(tokenizer, chunks.append, ("STOP",))
    streamer.put(torch.tensor([[1, 2]]))
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert "".join(chunks) == "a drama — very "
    # several pieces as the tokens came; none a broken character
    assert len(chunks) > 3 and not any("\ufffd" in chunk for chunk in chunks)


def test_the_plain_layout_is_the_lcsb_tokenizers_template():
    """A base without a chat template gets lcsb's own layout, with its own eos closing each turn."""
    shipped = load_tokenizer(LAMP_TINY)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    want = shipped.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    shipped.chat_template = PLAIN_TEMPLATE
    assert shipped.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == want
    assert want == "<|system|>\ns<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_targets_a_preset_with_an_adapter_a_model_dir_and_a_recipe(world):
    adapter = world / "run" / "adapter"
    recipe, got = chat_target("lamp-tiny", [], adapter, None)
    assert recipe.model.name == "lamp-tiny" and got == adapter
    recipe, got = chat_target("lamp2", ["backend=cpu", "model.dtype=bfloat16"], adapter, None)
    assert recipe.name == "lamp2-tiny" and recipe.model.dtype == "bfloat16" and got == adapter
    recipe, got = chat_target(str(LAMP_TINY), [], None, None)
    assert recipe.model.name == str(LAMP_TINY.resolve()) and got is None


# --- the REPL: a pipe, a pseudo-terminal, bad input -----------------------------------------------------------------


def piped_chat(stdin: str, *args: str):
    """`lcsb chat ARGS` in this process with `stdin` as its (non-TTY) standard input."""
    from click.testing import CliRunner

    from lcsb_cli.cli import app

    with CliRunner().isolation(input=stdin) as (out, err, _):
        try:
            app(args=["chat", *args], prog_name="lcsb")
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, out.getvalue().decode(), err.getvalue().decode()


def transcript_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_without_a_tty_each_line_is_a_turn(world, tmp_path):
    log = tmp_path / "turns.jsonl"
    lines = [FIRST, "", SECOND, "/reset", THIRD, "/nope", "/exit", "never read"]
    code, stdout, stderr = piped_chat(
        "\n".join(lines) + "\n", str(world / "run"), "--max-new-tokens", "16", "--transcript", str(log)
    )
    assert code == 0, stderr
    turns = transcript_of(log)
    assert [t["user"] for t in turns] == [FIRST, SECOND, THIRD]
    # stdout holds the replies alone, one per turn
    assert stdout == "".join(t["reply"] + "\n" for t in turns)
    assert "[conversation cleared]" in stderr and "unknown command /nope" in stderr
    first, second, third = turns
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    assert second["prompt"].startswith(first["prompt"] + first["reply"])
    # the cache held turn 1 (but its reply's last token): a turn feeds only its new tokens
    assert second["reused_tokens"] == len(first["prompt_ids"]) + first["new_tokens"] - 1
    assert FIRST not in third["prompt"] and third["reused_tokens"] == 0


def test_a_model_without_a_template_chats_in_the_plain_layout(world, tmp_path):
    log = tmp_path / "turns.jsonl"
    code, stdout, stderr = piped_chat(
        f"{FIRST}\n", str(world / "plain"), "--max-new-tokens", "8", "--transcript", str(log)
    )
    assert code == 0, stderr
    assert "no chat template" in stderr
    (turn,) = transcript_of(log)
    assert turn["prompt"] == f"<|user|>\n{FIRST}<|endoftext|>\n<|assistant|>\n" and stdout == turn["reply"] + "\n"


class Screen:
    """The child's terminal as read from the pty master: everything written to it so far, \\r and escapes removed."""

    def __init__(self, fd: int):
        self.fd, self.raw = fd, b""

    @property
    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.raw.decode(errors="replace")).replace("\r", "")

    def read(self, timeout: float) -> bool:
        if not select.select([self.fd], [], [], timeout)[0]:
            return False
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:
            chunk = b""
        self.raw += chunk
        return bool(chunk)

    def wait_for(self, done, what: str, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while not done(self.text):
            if time.monotonic() > end:
                raise AssertionError(f"waited for {what}; the screen:\n{self.text}")
            self.read(0.2)

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())


def exit_code(pid: int, screen: Screen, timeout: float = 60) -> int | None:
    """The child's exit code once it ends (reading its last output meanwhile), or None: killed after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            while screen.read(0.2):
                pass
            return os.waitstatus_to_exitcode(status)
        screen.read(0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_the_repl_in_a_pseudo_terminal(world, tmp_path):
    """Two turns, /reset, a Ctrl-C while the third reply streams, then Ctrl-D; what the screen shows and what the
    model was given."""
    log = tmp_path / "turns.jsonl"
    env = {**os.environ, "TERM": "dumb", "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "lcsb_cli", "chat", str(world / "run"), "--max-new-tokens", "64"]
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.execve(sys.executable, [*args, "--transcript", str(log)], env)
    screen, code = Screen(fd), None
    try:
        screen.wait_for(lambda s: s.endswith("\n> "), "the first prompt")
        for n, line in enumerate([FIRST, SECOND], 1):
            screen.type(line + "\r")
            screen.wait_for(lambda s, n=n: log.is_file() and len(transcript_of(log)) == n and s.endswith("\n> "), line)
        screen.type("/reset\r")
        screen.wait_for(lambda s: s.endswith("[conversation cleared]\n> "), "/reset")
        screen.type(THIRD + "\r")
        screen.wait_for(lambda s: f"> {THIRD}\n" in s and len(s.rpartition(f"{THIRD}\n")[2]) > 8, "the reply")
        screen.type("\x03")
        screen.wait_for(lambda s: s.endswith("[reply stopped]\n> "), "Ctrl-C to stop the reply")
        screen.type("\x04")
        code = exit_code(pid, screen)
    finally:
        if code is None:
            exit_code(pid, screen, timeout=0)
        os.close(fd)
        Path("/tmp/chat_screen.txt").write_text(screen.text)
    assert code == 0, screen.text
    text = screen.text
    first, second, third = transcript_of(log)
    assert text.startswith("chatting with lamp-tiny + ") and "/reset clears the conversation" in text
    # each line as typed, then its reply as it streamed (both longer than --max-new-tokens)
    cut = "[reply cut at --max-new-tokens 64]"
    assert (
        f"> {FIRST}\n{first['reply']}\n{cut}\n> {SECOND}\n{second['reply']}\n{cut}\n> /reset\n[conversation cleared]\n"
        in text
    )
    assert first["ended"] == second["ended"] == "max_new_tokens" and first["new_tokens"] == 64
    # the terminal echoes ^C where the reply had got to
    stopped = text.rpartition(f"> {THIRD}\n")[2]
    assert "^C" in stopped and stopped.replace("^C", "") == third["reply"] + "\n[reply stopped]\n> \n"
    assert third["ended"] == "interrupted" and 0 < third["new_tokens"] < 64 and third["reply"]
    assert "Traceback" not in text and "error:" not in text
    # the second turn's prompt holds the first turn; after /reset the third holds neither
    assert second["prompt"].startswith(first["prompt"] + first["reply"]) and SECOND in second["prompt"]
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    # the cache held turn 1 (but its reply's last token): a turn feeds only its new tokens
    assert second["reused_tokens"] == len(first["prompt_ids"]) + first["new_tokens"] - 1
    assert FIRST not in third["prompt"] and third["reused_tokens"] == 0


# (id, args with {w} for the world dir, words the single error line must hold)
BAD = [
    ("missing-run-dir", ["{w}/no-such-run"], ["no-such-run", "not found", "preset"]),
    ("unknown-user", ["{w}/per_user", "--user", "nobody"], ["--user", "nobody"]),
    ("per-user-run-without-user", ["{w}/per_user"], ["per_user", "--user ID"]),
    ("user-with-a-preset", ["lamp-tiny", "--user", "u1"], ["--user", "run dir"]),
    ("adapter-not-an-adapter", ["lamp-tiny", "--adapter", "{w}"], ["--adapter", "adapter_config.json"]),
    ("model-dir-with-override", ["{w}/plain", "backend=cuda"], ["plain", "override"]),
    ("preset-with-override", ["lamp-tiny", "backend=cuda"], ["lamp-tiny", "override", "model.name=lamp-tiny"]),
    ("bad-override", ["{w}/run", "model.dtyp=float32"], ["dtyp"]),
    ("transcript-in-missing-dir", ["{w}/run", "--transcript", "{w}/nowhere/t.jsonl"], ["--transcript", "nowhere"]),
    ("negative-temperature", ["{w}/run", "--temperature", "-1"], ["--temperature"]),
]


@pytest.mark.parametrize("args,needles", [pytest.param(a, n, id=i) for i, a, n in BAD])
def test_bad_input_exits_2_with_one_line(world, args, needles):
    proc = cli("chat", *[a.replace("{w}", str(world)) for a in args])
    assert_one_line_error(proc, *needles)


def test_help_names_the_commands_and_the_sampling_flags():
    proc = cli("chat", "-h")
    assert proc.returncode == 0, proc.stderr
    words = " ".join(proc.stdout.split())
    for needle in ("Examples:", "/reset", "/system TEXT", "/exit", "Ctrl-C", "--user", "--max-new-tokens", "--stop"):
        assert needle in words, needle
