"""KV-cached decoding against a cache-free greedy loop, and `lcsb generate` on a run dir, its merged export and bad
input (exit 2, one line, nothing touched)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import LAMP2, REPO, assert_one_line_error, cli, run_train, snapshot

from lcsb_cli.errors import BadInput
from lcsb_cli.generate import chat_prompt_ids, generate_ids, generate_texts
from lcsb_cli.model.load import load_model, load_tokenizer
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import resolve_target

# one worker trains and exports the module's run once
pytestmark = pytest.mark.xdist_group("generate")

CPU = torch.device("cpu")
PROMPTS = ["Which tag does this movie relate to?", "A long description of a film where many things happen and"]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def tiny():
    """The tiny-qwen2 preset with seeded random LoRA B weights, so the adapter path changes every logit."""
    loaded = load_model(load_recipe(LAMP2), CPU)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return loaded


def greedy_without_cache(model, prompt: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
    """The reference: one unpadded prompt, a full forward per new token, argmax, stop before a stop token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            if token in stops:
                break
            ids.append(token)
    return ids[len(prompt) :]


def test_batched_cached_greedy_equals_a_full_forward_loop(tiny):
    prompts = [tiny.tokenizer(text)["input_ids"] for text in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    model = tiny.model.train()

    got = generate_ids(model, tiny.tokenizer, prompts, 16)

    # inference_mode put it back
    assert model.training
    want = [greedy_without_cache(model.eval(), p, 16, {tiny.tokenizer.eos_token_id}) for p in prompts]
    assert got == want
    # not a degenerate repetition
    assert all(len(set(tokens)) > 4 for tokens in got), got


def test_a_generation_config_eos_stops_it_and_is_cut(tiny):
    """SmolLM2's chat ends a turn with <|im_end|>, named in generation_config rather than as the tokenizer's eos."""
    prompts = [tiny.tokenizer(text)["input_ids"] for text in PROMPTS]
    free = generate_ids(tiny.model, tiny.tokenizer, prompts, 16)
    stop = free[0][5]
    config = tiny.model.generation_config
    saved, config.eos_token_id = config.eos_token_id, stop
    try:
        got = generate_ids(tiny.model, tiny.tokenizer, prompts, 16)
    finally:
        config.eos_token_id = saved
    eos = tiny.tokenizer.eos_token_id
    assert got == [greedy_without_cache(tiny.model.eval(), p, 16, {eos, stop}) for p in prompts]
    assert got[0] == free[0][: free[0].index(stop)]


def test_a_stop_string_ends_its_row_early_and_is_cut_from_the_text(tiny):
    prompts = [tiny.tokenizer(text)["input_ids"] for text in PROMPTS]
    free_ids = generate_ids(tiny.model, tiny.tokenizer, prompts, 16)
    free = generate_texts(tiny.model, tiny.tokenizer, prompts, 16)
    words = free[0].split()
    # a word from the middle of row 0's answer
    stop = words[len(words) // 2]
    assert len(words) >= 3 and len(free_ids[0]) == 16

    got_ids = generate_ids(tiny.model, tiny.tokenizer, prompts, 16, stop=[stop])
    got = generate_texts(tiny.model, tiny.tokenizer, prompts, 16, stop=[stop, "never in any text"])

    assert got == [text[: text.index(stop)] if stop in text else text for text in free]
    # ended there
    assert len(got_ids[0]) < len(free_ids[0]) and got_ids[0] == free_ids[0][: len(got_ids[0])]
    assert got_ids[1] == free_ids[1][: len(got_ids[1])]


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(tiny):
    prompts = [tiny.tokenizer(PROMPTS[0])["input_ids"]]
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = generate_ids(tiny.model, tiny.tokenizer, prompts, 12, temperature=1.5, seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    assert generate_ids(tiny.model, tiny.tokenizer, prompts, 12, temperature=1.5, seed=7) == first
    assert generate_ids(tiny.model, tiny.tokenizer, prompts, 12, temperature=1.5, seed=8) != first
    assert first != generate_ids(tiny.model, tiny.tokenizer, prompts, 12)


def test_chat_prompt_ids_is_a_plain_list_from_the_template(tiny):
    tokenizer = load_tokenizer(tiny.base_dir)
    tokenizer.chat_template = TEMPLATE
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi there"}])
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tokenizer("[user] hi there\n[assistant]", add_special_tokens=False)["input_ids"]
    tokenizer.chat_template = None
    with pytest.raises(BadInput, match="no chat template"):
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])


# --- a trained run, its merged export and the CLI ------------------------------------------------


def _with_template(source: Path, target: Path, template: str | None) -> Path:
    """A copy of a model dir whose tokenizer has exactly `template` as its chat template (None: none)."""
    shutil.copytree(source, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_file = target / "tokenizer_config.json"
    config = {k: v for k, v in json.loads(config_file.read_text()).items() if k != "chat_template"}
    config_file.write_text(json.dumps({**config, **({"chat_template": template} if template else {})}))
    return target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    run = root / "run"
    run_train(run, "train.max_steps=8", "train.lr=1e-2", "train.warmup_steps=0", "train.save_every=0")
    exported = cli("export", str(run), "--output", str(root / "merged"), "--merge")
    assert exported.returncode == 0, exported.stderr
    _with_template(root / "merged", root / "plain", None)
    _with_template(root / "merged", root / "chat", TEMPLATE)
    (root / "per_user").mkdir()
    config = (run / "config.yaml").read_text()
    assert "\n  user: null\n" in config
    (root / "per_user" / "config.yaml").write_text(config.replace("\n  user: null\n", "\n  user: all\n"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def _generated(*args: str) -> str:
    proc = cli("generate", *args, "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") >= 1
    return proc.stdout


def test_a_run_and_its_merged_export_generate_the_same_tokens(world):
    run_recipe, adapter, _ = resolve_target(str(world / "run"), [], None)
    merged_recipe, no_adapter, _ = resolve_target(str(world / "merged"), [], None, model_dir_ok=True)
    assert adapter == world / "run" / "adapter" and no_adapter is None
    outputs = []
    for recipe, path in ((run_recipe, adapter), (merged_recipe, None)):
        loaded = load_model(recipe, CPU, path)
        outputs.append(
            generate_ids(loaded.model, loaded.tokenizer, [loaded.tokenizer(p)["input_ids"] for p in PROMPTS], 12)
        )
    assert outputs[0] == outputs[1]


def test_cli_run_dir_equals_merged_export_and_differs_from_the_base(world):
    file = str(world / "prompts.jsonl")
    from_run = _generated(str(world / "run"), "--file", file)
    assert from_run == _generated(str(world / "merged"), "--file", file)
    # the base model
    assert from_run != _generated(str(LAMP2.relative_to(REPO)), "--file", file)
    one = _generated(str(world / "run"), "--prompt", PROMPTS[0])
    assert one == _generated(str(world / "merged"), "--prompt", PROMPTS[0])
    # printed text from the middle of the generation
    stop = one.strip()[len(one.strip()) // 2 :][:3]
    assert _generated(str(world / "run"), "--prompt", PROMPTS[0], "--stop", stop) == one[: one.index(stop)] + "\n"


@pytest.mark.parametrize("model_dir", ["merged", "lamp-tiny"])
def test_exported_and_shipped_models_name_their_end_of_text(world, model_dir):
    from transformers import AutoConfig, GenerationConfig

    path = world / model_dir if model_dir == "merged" else REPO / "configs" / "models" / model_dir
    eos = load_tokenizer(path).eos_token_id
    assert eos is not None
    assert AutoConfig.from_pretrained(path).eos_token_id == eos
    # what plain `generate` stops at
    assert GenerationConfig.from_pretrained(path).eos_token_id == eos


def test_cli_chat_applies_the_template_to_a_prompt_and_to_messages(world):
    chat = world / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a tag."}]}
        )
        + "\n"
        + json.dumps({"prompt": PROMPTS[0]})
        + "\n"
    )
    rendered = world / "rendered.jsonl"
    rendered.write_text(
        json.dumps({"prompt": "[system] Be brief.\n[user] Name a tag.\n[assistant]"})
        + "\n"
        + json.dumps({"prompt": f"[user] {PROMPTS[0]}\n[assistant]"})
        + "\n"
    )
    with_chat = _generated(str(world / "chat"), "--chat", "--file", str(chat))
    assert with_chat == _generated(str(world / "chat"), "--file", str(rendered))
    assert with_chat != _generated(str(world / "chat"), "--file", str(world / "prompts.jsonl"))


# (id, args with {w} for the world dir, words the single error line must hold)
BAD = [
    ("chat-without-template", ["{w}/plain", "--chat", "--prompt", "hi"], ["no chat template"]),
    ("prompt-and-file", ["{w}/run", "--prompt", "hi", "--file", "{w}/prompts.jsonl"], ["exactly one", "--prompt"]),
    ("neither-prompt-nor-file", ["{w}/run"], ["exactly one", "--file"]),
    ("missing-user-adapter", ["{w}/run", "--user", "nobody", "--prompt", "hi"], ["--user", "nobody"]),
    ("per-user-run-without-user", ["{w}/per_user", "--prompt", "hi"], ["per_user", "--user ID"]),
    ("missing-run-dir", ["{w}/no-such-run", "--prompt", "hi"], ["no-such-run", "not found"]),
    ("dir-not-a-run", ["{w}/notes", "--prompt", "hi"], ["notes", "not a run directory"]),
    ("file-bad-json", ["{w}/run", "--file", "{w}/bad.jsonl"], ["bad.jsonl", "line 2", "json"]),
    ("messages-without-chat", ["{w}/run", "--file", "{w}/messages.jsonl"], ["messages.jsonl", "--chat"]),
    ("merged-with-override", ["{w}/merged", "backend=cuda", "--prompt", "hi"], ["merged", "override"]),
    ("negative-temperature", ["{w}/run", "--prompt", "hi", "--temperature", "-1"], ["--temperature"]),
]


@pytest.mark.parametrize("args,needles", [pytest.param(a, n, id=i) for i, a, n in BAD])
def test_bad_input_exits_2_with_one_line(world, args, needles):
    (world / "notes").mkdir(exist_ok=True)
    (world / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": \n')
    (world / "messages.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    before = snapshot(world)

    proc = cli("generate", *[a.replace("{w}", str(world)) for a in args])

    assert_one_line_error(proc, *needles)
    assert snapshot(world) == before
