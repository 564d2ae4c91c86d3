"""Memory techniques on small presets: each gives the same numbers as the plain path and moves its figure down."""

import gc
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import LAMP2, REPO, lcsb, model_and_first_batch, without_cache_caps
from safetensors.torch import load_file

from lcsb_cli.data import build_train_batches
from lcsb_cli.errors import BadInput
from lcsb_cli.methods import make_optimizer
from lcsb_cli.model import load as models
from lcsb_cli.model import losses, memory, streamed
from lcsb_cli.model.load import load_model
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.model.mesp import MespLinear
from lcsb_cli.recipe import load_recipe
from lcsb_cli.selective import SelectiveLayers, partition

STREAMED = ["quantization=nf4", "memory.streamed_load=true"]


def loss_and_grads(*overrides):
    loaded, batch = model_and_first_batch(*overrides, for_gradients=True)
    loss = causal_lm_loss(loaded.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in loaded.model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_streamed_4bit_load_equals_transformers_bitsandbytes_load():
    # tiny-qwen2's checkpoint read a tensor at a time vs from_pretrained(BitsAndBytesConfig): bit-identical
    bf16 = "model.dtype=bfloat16"
    assert_same(loss_and_grads(*STREAMED, bf16), loss_and_grads("quantization=nf4", bf16))


@pytest.fixture
def streamed_preset(tmp_path, monkeypatch):
    """A tiny preset with `init: streamed`, in its own preset dir and cache."""
    spec = yaml.safe_load((models.PRESET_DIR / "tiny-qwen2.yaml").read_text())
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny-streamed.yaml").write_text(yaml.safe_dump({**spec, "init": "streamed"}))
    monkeypatch.setattr(models, "PRESET_DIR", tmp_path / "presets")
    monkeypatch.setenv("LCSB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_streamed_preset_is_the_same_model_whole_module_by_module_and_from_its_cache(streamed_preset):
    name = "model.name=tiny-streamed"
    # whole: the fp32 checkpoint quantization=none materialises, quantized by transformers
    whole = loss_and_grads(name, "quantization=nf4")
    # drawn and quantized one module at a time, then cached
    built = loss_and_grads(name, *STREAMED)
    cached = list(streamed_preset.glob("quantized/tiny-streamed-*/model.safetensors"))
    assert len(cached) == 1
    assert_same(built, whole)
    # loaded from the cache
    assert_same(loss_and_grads(name, *STREAMED), built)
    assert len(list(streamed_preset.glob("quantized/*"))) == 1
    # a cache file cut short: rebuilt, same model
    cached[0].write_bytes(cached[0].read_bytes()[:1000])
    assert_same(loss_and_grads(name, *STREAMED), built)
    assert cached[0].stat().st_size > 1000


def test_streamed_build_never_holds_the_full_precision_model(monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    # the embedding drawn in 16 chunks, as 4096 of 151,936 rows
    monkeypatch.setattr(streamed, "DRAW_ROWS", 256)
    spec = yaml.safe_load((models.PRESET_DIR / "tiny-qwen2.yaml").read_text())
    config = AutoConfig.for_model(spec["architecture"], **spec["config"])
    with memory.LiveBytes() as whole:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full_precision = sum(p.nbytes for p in model.parameters())
    with memory.LiveBytes() as built:
        streamed.streamed_model(config, torch.float32, "nf4", "nf4", streamed.RandomInit(0, 0.02))
    assert whole.peak >= full_precision
    assert built.peak < full_precision / 3


def test_4bit_embedding_cache_reloads_the_same_model(streamed_preset):
    args = ("model.name=tiny-streamed", *STREAMED, "memory.embedding=nf4", "model.dtype=bfloat16")
    built = loss_and_grads(*args)
    assert torch.isfinite(built[0])
    assert_same(loss_and_grads(*args), built)


def test_4bit_rows_dequantize_any_rows_exactly_like_the_whole_matrix():
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    weight = torch.randn(300, 128, generator=torch.Generator().manual_seed(0))
    packed, state = quantize_4bit(weight, blocksize=64, quant_type="nf4")
    whole = dequantize_4bit(packed, state)
    rows = streamed.QuantizedRows.quantize(weight.split(7), 300, 128, "nf4")
    assert torch.equal(rows.packed.flatten(), packed.flatten())
    assert torch.equal(rows.slice(0, 300, torch.float32), whole)
    assert torch.equal(rows.slice(123, 250, torch.float32), whole[123:250])
    ids = torch.tensor([[5, 299, 5], [0, 17, 42]])
    assert torch.equal(streamed.QuantizedEmbedding(rows, torch.float32)(ids), F.embedding(ids, whole))
    hidden = torch.randn(4, 128)
    head = streamed.QuantizedHead(rows, slice_rows=64)
    torch.testing.assert_close(head(hidden), hidden @ whole.T, rtol=0, atol=1e-5)


def chunked_and_full(head, whole, targets=40, vocab=1000):
    hidden = torch.randn(targets, whole.shape[1], requires_grad=True, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, vocab, (targets,), generator=torch.Generator().manual_seed(2))
    chunked = losses.head_cross_entropy(head, hidden, labels)
    (chunked_grad,) = torch.autograd.grad(chunked, hidden)
    full = F.cross_entropy(F.linear(hidden, whole), labels, reduction="sum")
    (full_grad,) = torch.autograd.grad(full, hidden)
    return chunked, chunked_grad, full, full_grad


@pytest.mark.parametrize("kind", ["linear", "4bit"])
def test_chunked_cross_entropy_equals_the_full_logits_loss_and_gradients(monkeypatch, kind):
    # 40 targets x 64 vocabulary rows: 16 slices
    monkeypatch.setattr(losses, "CHUNK_BYTES", 64 * 40 * 4)
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    if kind == "linear":
        head = torch.nn.Linear(64, 1000, bias=False).requires_grad_(False)
        head.weight.copy_(weight)
        whole = weight
    else:
        rows = streamed.QuantizedRows.quantize([weight], 1000, 64, "nf4")
        head, whole = streamed.QuantizedHead(rows), rows.slice(0, 1000, torch.float32)
    chunked, chunked_grad, full, full_grad = chunked_and_full(head, whole)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_grad, full_grad, rtol=1e-4, atol=2e-5)


def test_a_head_with_forward_hooks_is_applied_whole_so_the_hooks_see_it():
    loaded, batch = model_and_first_batch()
    calls = []
    loaded.model.get_output_embeddings().register_forward_hook(lambda module, args, out: calls.append(out.shape))
    causal_lm_loss(loaded.model, batch).backward()
    n_targets = int((batch["labels"][:, 1:] != -100).sum())
    assert calls == [torch.Size([n_targets, 4096])]


def test_chunked_cross_entropy_never_holds_the_full_logits(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_BYTES", 2**20)
    hidden = torch.randn(256, 64, requires_grad=True)
    head = torch.nn.Linear(64, 16384, bias=False).requires_grad_(False)
    labels = torch.randint(0, 16384, (256,))
    # 16 MiB of fp32 logits
    full_logits = 256 * 16384 * 4
    peaks = {}
    for name, fn in [
        ("chunked", lambda: losses.head_cross_entropy(head, hidden, labels)),
        ("full", lambda: F.cross_entropy(head(hidden).float(), labels, reduction="sum")),
    ]:
        with memory.LiveBytes() as live:
            fn().backward()
        peaks[name] = live.peak
    assert peaks["full"] >= full_logits
    assert peaks["chunked"] < full_logits / 4


def test_probe_sees_checkpointing_shrink_the_active_blocks_saved_activations():
    loaded, batch = model_and_first_batch()
    probe, saved = loaded.probe, {}
    loaded.model.train()
    for checkpointing in (True, False):
        selective = SelectiveLayers(loaded.layers, partition(4, 2), "identity", checkpointing)
        selective.activate(0)
        probe.activations = 0
        causal_lm_loss(loaded.model, batch, probe).backward()
        saved[checkpointing] = probe.activations
        selective.remove()
    assert probe.grads > 0 and probe.logits > 0
    assert 0 < saved[True] < saved[False] / 3


def test_8bit_adamw_keeps_a_quarter_of_the_state_and_moves_like_adamw():
    state_bytes, moved = {}, {}
    for kind in ("adamw", "adamw8bit"):
        param = torch.nn.Parameter(torch.ones(64, 1024))
        optimizer = make_optimizer(kind, [param], lr=1e-2, weight_decay=0.0)
        for step in range(3):
            param.grad = torch.randn(64, 1024, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        state_bytes[kind] = sum(t.nbytes for t in optimizer.state[param].values() if torch.is_tensor(t))
        moved[kind] = param.detach() - 1
    assert state_bytes["adamw8bit"] < state_bytes["adamw"] / 3
    assert F.cosine_similarity(moved["adamw"].flatten(), moved["adamw8bit"].flatten(), dim=0) > 0.99


def run_python(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True, env=without_cache_caps()
    )
    return float(out.stdout.split()[-1])


ALLOCATE = """
import ctypes, ctypes.util, sys
from lcsb_cli.model.memory import configure_allocator, rss_mb
configure_allocator({threshold})
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.free(libc.malloc(4 * 2**20))  # as a freed large tensor does: glibc raises its dynamic threshold to 4 MiB
start, keep, transient = rss_mb(), [], []
for _ in range(400):  # 200 KB blocks, each followed by a smaller block that outlives it
    transient.append(libc.malloc(200 * 1024))
    ctypes.memset(transient[-1], 1, 200 * 1024)
    keep.append(libc.malloc(32 * 1024))
for block in transient:
    libc.free(block)
print(rss_mb() - start)
"""


@pytest.mark.slow
def test_mmap_threshold_returns_freed_blocks_the_heap_would_keep():
    kept = run_python(ALLOCATE.format(threshold=0))
    returned = run_python(ALLOCATE.format(threshold=128))
    assert kept > 40 and returned < 5


KERNELS = """
import torch
from lcsb_cli.model.memory import limit_kernel_caches, rss_mb
limit_kernel_caches({entries})
weight = torch.randn(1024, 512, dtype=torch.bfloat16)
start = rss_mb()
for rows in range(100, 164):  # a batch length never seen before, each time
    torch.nn.functional.linear(torch.randn(rows, 512, dtype=torch.bfloat16), weight)
print(rss_mb() - start)
"""


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="without native bf16 (AVX512-BF16 / AMX) oneDNN caches no per-shape bf16 kernels to cap",
)
def test_kernel_cache_limit_stops_growth_with_batch_length():
    assert run_python(KERNELS.format(entries=4)) < run_python(KERNELS.format(entries=0)) / 2


def test_breakdown_parts_match_what_the_test_counts_itself():
    """Each part against an independent count: the LoRA tensors, AdamW moments and gradients the test sums, and the
    bytes the decoder's forward leaves allocated (what its graph holds for backward), tracked allocation by
    allocation, not by the probe's save hooks."""
    # tensors other tests in this worker left alive count too: hold them so they stay what they are
    gc.collect()
    earlier = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and t.device.type == "cpu"]
    earlier_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in earlier}.values())
    recipe = load_recipe(LAMP2, [*STREAMED, "memory.embedding=nf4", "model.dtype=bfloat16", "lora.rank=64"])
    loaded = load_model(recipe, torch.device("cpu"))
    loaded.model.train()
    lora = [p for p in loaded.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-3)
    # every storage the forward creates and still holds when it returns
    with memory.LiveBytes() as forward:
        loss = causal_lm_loss(loaded.model, build_train_batches(recipe, loaded.tokenizer).batch(0), loaded.probe)
    held = forward.live
    loss.backward()
    grads = sum(p.grad.nbytes for p in lora)
    optimizer.step()
    # as the trainer does: the step's gradients are gone when it reports
    optimizer.zero_grad(set_to_none=True)
    moments = sum(t.nbytes for state in optimizer.state.values() for t in state.values())
    del loss
    gc.collect()
    resident_now = memory.rss_mb()
    figures = memory.breakdown(loaded.model, loaded.probe, loaded.runtime_mb)
    mb = 2**-20
    # counted right
    assert moments >= 2 * sum(p.nbytes for p in lora) and grads == sum(p.nbytes for p in lora)
    assert figures["lora_optimizer_mb"] == pytest.approx(
        (earlier_bytes + sum(p.nbytes for p in lora) + moments + grads) * mb, abs=0.1
    )
    # the forward holds the decoder's saved activations plus a few KB of the head's (its targets' hidden rows, lse)
    assert held - 2**14 <= loaded.probe.activations <= held
    assert figures["activations_mb"] == pytest.approx(held * mb, abs=0.1)
    # chunked head: a slice of logits at a time
    assert 0 < figures["logits_mb"] < 0.2 * figures["activations_mb"]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in memory.frozen_tensors(loaded.model)
    }
    assert figures["weights_mb"] == pytest.approx(sum(storages.values()) * mb, abs=0.1)
    # packed 4-bit weights
    assert any(t.dtype == torch.uint8 for t in memory.frozen_tensors(loaded.model))
    assert 0 < figures["runtime_mb"] < figures["peak_rss_mb"] and resident_now <= figures["peak_rss_mb"]


@pytest.mark.slow
def test_a_runs_summary_breakdown_holds_lora_and_adamw_and_leaves_no_negative_rest(tmp_path):
    """In a process of its own (as a user runs it) the parts were all resident above the runtime at once, so the
    unexplained rest cannot be negative. Full backprop keeps per adapter parameter at least 16 bytes (the fp32
    weight, AdamW's two moments, one step's gradient) and at most 24 more (the divergence guard's two copies of the
    weight and moments: the last clean state and the one at the lowest mean loss, for a slow climb)."""
    run = tmp_path / "run"
    proc = lcsb("train", str(LAMP2), "train.max_steps=2", "lora.rank=64", "method=full-backprop", "--output", str(run))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads((run / "summary.json").read_text())["memory"]
    params = sum(t.numel() for t in load_file(run / "adapter" / "adapter_model.safetensors").values())
    assert 16 * params / 2**20 - 0.1 <= figures["lora_optimizer_mb"] <= 40 * params / 2**20 + 0.1
    assert figures["other_mb"] >= 0 and figures["runtime_mb"] < figures["peak_rss_mb"]


def test_memory_recipe_builds_its_0_5b_model_4bit_with_full_one_row_batches():
    """recipes/memory-0.5b.yaml's settings take effect: its preset is a 0.5B model, and (on the tiny preset, with
    every other setting kept) its frozen weights, embedding and head load 4-bit, and profile items fill each
    single-row batch to max_length."""
    path = REPO / "recipes" / "memory-0.5b.yaml"
    spec = yaml.safe_load((models.PRESET_DIR / f"{load_recipe(path).model.name}.yaml").read_text())
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec["architecture"], **spec["config"]))
    assert 0.45e9 < sum(p.numel() for p in model.parameters()) < 0.55e9
    recipe = load_recipe(path, ["model.name=tiny-qwen2"])
    loaded = load_model(recipe, torch.device("cpu"))
    frozen = [p for p in loaded.model.parameters() if not p.requires_grad]
    packed = [p for p in frozen if p.dtype == torch.uint8]
    # every projection's frozen weight is packed 4-bit
    assert len(packed) == 7 * len(loaded.layers)
    assert sum(isinstance(m, MespLinear) for m in loaded.model.modules()) == 7 * len(loaded.layers)
    # norms and biases
    assert {p.dtype for p in frozen if p.dtype != torch.uint8} == {torch.bfloat16}
    assert isinstance(loaded.model.get_input_embeddings(), streamed.QuantizedEmbedding)
    assert isinstance(loaded.model.get_output_embeddings(), streamed.QuantizedHead)
    assert build_train_batches(recipe, loaded.tokenizer).batch(0)["input_ids"].shape == (1, recipe.data.max_length)
    without_profile = build_train_batches(
        load_recipe(path, ["model.name=tiny-qwen2", "data.profile_k=0"]), loaded.tokenizer
    )
    assert without_profile.batch(0)["input_ids"].shape[1] < recipe.data.max_length


@pytest.mark.parametrize("embedding", ["keep", "nf4"])
def test_a_checkpoint_that_disagrees_with_its_config_is_bad_input(tmp_path, embedding):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(models.materialize_preset("tiny-qwen2"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    recipe = load_recipe(LAMP2, [f"model.name={checkpoint}", *STREAMED, f"memory.embedding={embedding}"])
    with pytest.raises(BadInput, match=r"model.name: tensor 'model.embed_tokens.weight' has shape \[4096, 64\]"):
        load_model(recipe, torch.device("cpu"))


def test_4bit_rows_refuse_a_width_that_is_not_whole_blocks():
    with pytest.raises(BadInput, match="memory.embedding: .* multiple of 64, this model's is 96"):
        streamed.QuantizedRows(10, 96, "nf4")


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["memory.embedding=nf4"], "memory.embedding"),
        (["memory.streamed_load=true"], "memory.streamed_load"),
        (["quantization=nf4", "memory.streamed_load=true", "backend=cuda"], "memory.streamed_load"),
        (["train.optimizer=sgd"], "train.optimizer"),
        ([*STREAMED, "model.trust_remote_code=true"], "memory.streamed_load"),
    ],
)
def test_memory_settings_that_cannot_work_are_bad_input(overrides, key):
    with pytest.raises(BadInput, match=key):
        load_recipe(LAMP2, overrides)


def test_each_user_of_a_per_user_run_reports_its_own_peak_and_no_negative_part(tmp_path):
    """A transient 512 MiB before the run raised the process's high-water mark; no user's peak may include it, and
    no user's live tensors may include an earlier user's (a 30-user run grew 14 MB a user that way)."""
    from helpers import run_train

    dev = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_questions.json").read_text())
    golds = json.loads((REPO / "recipes" / "data" / "lamp2" / "dev_outputs.json").read_text())["golds"]
    two = [q for q in dev if q["user_id"] in ("user_00", "user_01")]
    (tmp_path / "q.json").write_text(json.dumps(two))
    (tmp_path / "o.json").write_text(
        json.dumps({"task": "LaMP_2", "golds": [g for g in golds if g["id"] in {q["id"] for q in two}]})
    )
    blob = torch.ones(128 * 2**20)
    high_water = memory.peak_rss_mb()
    del blob
    run_train(
        tmp_path / "run",
        "data.user=all",
        f"data.eval={tmp_path / 'q.json'}",
        f"data.eval_labels={tmp_path / 'o.json'}",
        "train.max_steps=2",
    )
    users = [
        json.loads((tmp_path / "run" / "users" / u / "summary.json").read_text())["memory"]
        for u in ("user_00", "user_01")
    ]
    for parts in users:
        assert parts["peak_rss_mb"] < high_water - 256, parts
        assert all(value >= 0 for value in parts.values()), parts
    # the first user's tensors were freed
    assert users[1]["lora_optimizer_mb"] == users[0]["lora_optimizer_mb"]
