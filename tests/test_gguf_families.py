"""The GGUF files users download, family by family (tests/gguf_families.py builds them: small random-init llama with
GQA, qwen2, qwen3 with head_dim 64 and 128, mistral, gemma3 and phi3, quantized by llama.cpp's own quantizer).

Each F16 file reads back as the checkpoint it was written from (the config transformers builds, completed from the
file's metadata and tensors: head size, partial rotation, attention scale, Llama 3's, Gemma 3's and Phi-3's rotary
scaling). Each quantized file trains packed with the default targets, its first-step loss equals the
dequantized path's, and its adapter exports and generates in llama.cpp. A type the packed layers cannot read is one
line before any conversion, and transformers' progress bar never reaches stderr."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from gguf_families import FAMILIES, checkpoint, family_file
from helpers import LAMP2, assert_one_line_error, cli

from lcsb_cli.errors import BadInput
from lcsb_cli.model.gguf import config as gguf_config
from lcsb_cli.model.gguf import convert as gguf_in
from lcsb_cli.model.gguf.index import GgufIndex
from lcsb_cli.recipe import load_recipe
from lcsb_cli.recipe.schema import LoraConfig
from lcsb_cli.run.entry import train
from lcsb_cli.run.hooks import SilentDisplay
from lcsb_cli.rundir import read_metrics

# its own worker: the files and their conversions are built once, under locks, in the session's cache
pytestmark = pytest.mark.xdist_group("gguf-families")
SHORT = [
    "data.user=null",
    "train.batch_size=1",
    "data.max_length=96",
    "train.warmup_steps=0",
    "method=full-backprop",
    # the default targets (all-linear: Phi-3's fused projections too)
    f"lora.targets=[{', '.join(LoraConfig().targets)}]",
]
# every family as Q4_K_M and Q8_0; the newly read types on llama (their files mix Q2_K + Q3_K, Q3_K + Q4_K + Q5_K,
# IQ4_NL + Q5_K, IQ4_XS + Q5_K)
MATRIX = [(family, kind) for family in FAMILIES for kind in ("Q4_K_M", "Q8_0")] + [
    ("llama", kind) for kind in ("Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS")
]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_f16_file_reads_back_as_the_checkpoint_it_was_written_from(family):
    from transformers import AutoModelForCausalLM

    cache = Path(os.environ["LCSB_CACHE"]) / "gguf"
    converted = gguf_in.converted_checkpoint(family_file(family), torch.float32, cache)
    ours = AutoModelForCausalLM.from_pretrained(converted).eval()
    # longer than Gemma 3's window of 16 and the scaled families' original contexts of 16 and 32
    ids = torch.randint(0, 1800, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Llama 3's frequency factors reach transformers as float32 divisors, not as its llama3 formula
        tolerance = 1e-5 if family == "llama" else 0.0
        torch.testing.assert_close(ours(ids).logits, checkpoint(family)(ids).logits, rtol=0, atol=tolerance)


def _first_losses(tmp_path: Path, source: Path) -> tuple[list[dict], list[dict]]:
    runs = {}
    for kind, steps in (("gguf", 2), ("none", 1)):
        overrides = [f"model.name={source}", f"quantization={kind}", f"train.max_steps={steps}"]
        recipe = load_recipe(LAMP2, [*SHORT, *overrides])
        train(recipe, tmp_path / kind, SilentDisplay())
        runs[kind] = read_metrics(tmp_path / kind / "metrics.jsonl")
    return runs["gguf"], runs["none"]


@pytest.mark.slow
@pytest.mark.parametrize("family, kind", MATRIX)
def test_each_file_trains_packed_as_dequantized_and_its_adapter_runs_in_llama_cpp(tmp_path, family, kind):
    from gguf_readers import LlamaCpp

    from lcsb_cli.export import export_run

    source = family_file(family, kind)
    packed, dense = _first_losses(tmp_path, source)
    assert len(packed) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in packed)
    # the packed layers hold exactly the weights transformers dequantizes
    assert packed[0]["loss"] == dense[0]["loss"]
    types = Counter(t.tensor_type.name for t in GgufIndex(source).tensors.values() if t.name.startswith("blk."))
    print(f"\n{source.name}: {dict(types)}; first-step loss {packed[0]['loss']!r} packed and dequantized")
    adapter = export_run(tmp_path / "gguf", tmp_path / "adapter.gguf", fmt="gguf")
    with LlamaCpp(source, lora=adapter) as llm:
        assert len(llm.greedy(llm.tokenize("Which tag does this movie relate to?"), 4)) == 4


@pytest.mark.slow
def test_a_type_the_packed_layers_cannot_read_is_one_line_before_any_conversion(tmp_path, monkeypatch):
    """llama.cpp's TQ2_0 (ternary): refused naming the tensor, its type and the supported list, with nothing
    converted; the dequantized path reads the same file."""
    source = family_file("llama", "TQ2_0")
    monkeypatch.setenv("LCSB_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    proc = cli("train", str(LAMP2), *SHORT, f"model.name={source}", "quantization=gguf", "--output", str(run))
    line = assert_one_line_error(proc, "quantization: gguf", "blk.0.", "GGUF type TQ2_0 is not supported", "Q4_K")
    assert "quantization: none reads it" in line
    assert not run.exists() and not list((tmp_path / "cache").glob("gguf/*"))


@pytest.mark.slow
def test_the_conversion_progress_bar_goes_to_the_log_not_stderr(tmp_path, monkeypatch):
    source = family_file("qwen3-64", "Q8_0")
    # a cache of its own, so the file is converted in this command
    monkeypatch.setenv("LCSB_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    proc = cli("train", str(LAMP2), *SHORT, f"model.name={source}", "train.max_steps=1", "--output", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr and "Converting" not in proc.stderr, proc.stderr
    log = (run / "lcsb.log").read_text()
    assert "stderr.transformers: Converting and de-quantizing GGUF tensors...: 100%" in log


def _fields(arch: str, **keys) -> dict:
    base = {"embedding_length": 2048, "attention.head_count": 16, "block_count": 28}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}}


def test_the_config_takes_what_llama_cpp_reads_from_the_metadata():
    def overrides(fields: dict) -> dict:
        return gguf_config.config_overrides(fields, {})

    # Qwen3: head_dim from attention.key_length (transformers' default is 128), or hidden / heads without it
    assert overrides(_fields("qwen3", **{"attention.key_length": 64})) == {"head_dim": 64}
    assert overrides(_fields("qwen3")) == {"head_dim": 128}
    # Phi-4-mini: 96 of 128 dimensions rotate
    phi = _fields("phi3", **{"embedding_length": 3072, "attention.head_count": 24, "rope.dimension_count": 96})
    assert overrides(phi)["rope_parameters"]["partial_rotary_factor"] == 0.75
    # Gemma 3 scales attention by the head size, 27B (62 layers) by hidden / heads; 4B and up scale the global
    # layers' rotation linearly
    gemma = {"attention.key_length": 128, "attention.value_length": 128}
    assert overrides(_fields("gemma3", **gemma))["query_pre_attn_scalar"] == 128
    big = _fields("gemma3", **gemma, embedding_length=5376, block_count=62, **{"attention.head_count": 32})
    assert overrides(big)["query_pre_attn_scalar"] == 168
    linear = {**gemma, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    rope = overrides(_fields("gemma3", **linear))["rope_parameters"]
    assert rope["full_attention"]["factor"] == 8.0 and rope["sliding_attention"]["rope_type"] == "default"
    # an architecture not checked keeps transformers' own reading
    assert overrides(_fields("qwen3moe", **{"attention.key_length": 128})) == {}


@pytest.mark.parametrize(
    "arch, keys, why",
    [
        ("qwen2", {"attention.key_length": 64}, "its heads have 64 dimensions, not hidden size / heads"),
        ("qwen3", {"attention.key_length": 128, "attention.value_length": 64}, "values have 64 dimensions"),
        ("llama", {"rope.dimension_count": 64}, "it rotates 64 of each head's 128 dimensions"),
        ("qwen2", {"rope.scaling.type": "yarn"}, "lcsb does not read its rope scaling 'yarn'"),
    ],
)
def test_a_file_transformers_model_cannot_hold_is_refused_naming_why(arch, keys, why):
    with pytest.raises(BadInput, match=f"^model.name: transformers' {arch} model cannot hold this GGUF file: .*{why}"):
        gguf_config.config_overrides(_fields(arch, **keys), {})
