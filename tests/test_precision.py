"""train.autocast: what `auto` picks on which host, and bf16 autocast without per-step casts of frozen weights."""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import LAMP2, cli

from lcsb_cli.host import choose_autocast, host_kind, native_bf16_flag
from lcsb_cli.model.losses import head_cross_entropy
from lcsb_cli.model.precision import CastCounter, _CastOnce, store_frozen_in_bf16
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer
from lcsb_cli.rundir import read_metrics

X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n"


@pytest.mark.parametrize(
    "cpuinfo,flag",
    [
        (X86.format(extra="avx512_bf16 avx512_vnni"), "avx512_bf16"),
        (X86.format(extra="amx_tile amx_bf16 avx512_bf16"), "amx_bf16"),
        (X86.format(extra="avx512_vnni"), None),
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", "bf16"),
        ("processor\t: 0\nFeatures\t: fp asimd\nmodel name\t: bf16-lookalike\n", None),
    ],
)
def test_native_bf16_comes_from_the_cpu_flags(cpuinfo, flag):
    assert native_bf16_flag(cpuinfo) == flag


@pytest.mark.parametrize("host,picked", [("native", "bf16"), ("emulated", "none")])
def test_auto_picks_bf16_only_where_the_cpu_has_it(monkeypatch, host, picked):
    monkeypatch.setenv("LCSB_CPU_BF16", host)
    mode, why = choose_autocast("auto", "cpu")
    assert mode == picked and why.startswith(f"train.autocast: auto -> {picked}")
    assert ("emulated" in host_kind()) == (host == "emulated")
    # the NPU backends keep their own precision; an explicit choice stays
    assert choose_autocast("auto", "npu-sim")[0] == "none"
    assert choose_autocast("bf16", "cpu")[0] == "bf16" and choose_autocast("none", "cpu")[0] == "none"


@pytest.mark.parametrize("host,picked", [("native", "bf16"), ("emulated", "none")])
def test_a_run_says_first_what_auto_chose_and_records_it(monkeypatch, tmp_path, host, picked):
    monkeypatch.setenv("LCSB_CPU_BF16", host)
    run = tmp_path / "run"
    proc = cli("train", str(LAMP2), "train.autocast=auto", "train.max_steps=1", "train.save_every=0", "-o", str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith(f"train.autocast: auto -> {picked}: this CPU")
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["autocast"] == picked


def test_under_bf16_autocast_the_held_out_evaluations_run_on_the_bf16_frozen_weights(tmp_path):
    """The evaluations inside a run and a bench (not only the step) see the frozen weights stored in bf16."""
    run = tmp_path / "run"
    steps = ["train.autocast=bf16", "train.max_steps=2", "train.save_every=0"]
    proc = cli("train", str(LAMP2), *steps, "train.eval_every=1", "-o", str(run))
    assert proc.returncode == 0, proc.stderr
    assert len([row for row in read_metrics(run / "metrics.jsonl") if "eval_loss" in row]) == 2
    bench = tmp_path / "bench"
    proc = cli(
        "bench", str(LAMP2), *steps, "--compare", "lcsb:2", "--steps", "1", "--warmup", "0", "--eval", "-o", str(bench)
    )
    assert proc.returncode == 0, proc.stderr
    assert all(method["eval"] for method in json.loads((bench / "bench.json").read_text())["methods"])


def test_bf16_on_an_emulating_cpu_is_warned_about(monkeypatch, tmp_path):
    monkeypatch.setenv("LCSB_CPU_BF16", "emulated")
    proc = cli("validate", str(LAMP2), "train.autocast=bf16")
    assert proc.returncode == 0
    proc = cli("train", str(LAMP2), "train.autocast=bf16", "train.max_steps=1", "-o", str(tmp_path / "run"))
    assert proc.returncode == 0 and "emulated, slower than fp32" in proc.stderr.splitlines()[0]


def _trainer(*overrides):
    recipe = load_recipe(LAMP2, ["train.batch_size=2", "train.max_steps=4", *overrides])
    trainer, loaded, _ = build_trainer(recipe)
    trainer.divergence.good.take()
    loaded.model.train()
    return trainer, loaded.model


def test_bf16_autocast_stores_the_frozen_weights_once_and_casts_none_of_them():
    trainer, model = _trainer("method=full-backprop", "train.autocast=bf16")
    frozen = [m for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert frozen and all(m.weight.dtype == torch.bfloat16 for m in frozen)
    assert all(p.dtype == torch.float32 for p in trainer.params)
    # tied to the head, the embedding is bf16 too, its output fp32: the residual stream stays fp32
    embedding = model.get_input_embeddings()
    assert embedding.weight.dtype == torch.bfloat16
    assert embedding(torch.tensor([[1, 2]])).dtype == torch.float32
    with CastCounter(model) as casts:
        row = trainer.step(0)
    assert casts.counts["frozen weights"][0] == 0 and casts.counts["activations and LoRA"][0] > 0
    reference, _ = _trainer("method=full-backprop")
    assert row["loss"] == pytest.approx(reference.step(0)["loss"], rel=2e-2)


def test_autocast_over_fp32_weights_would_cast_each_of_them_every_step():
    """What the stored bf16 copy saves, and that the counter sees it."""
    trainer, model = _trainer("method=full-backprop")
    trainer.autocast = "bf16"
    with CastCounter(model) as casts:
        trainer.step(0)
    projections = sum(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in model.modules())
    assert casts.counts["frozen weights"][0] >= projections


def _hidden_casts(model, ids):
    """fp32 -> bf16 casts of hidden-state-shaped activations in one forward under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16), CastCounter(model) as casts:
        model(input_ids=ids)
    return casts.shapes[((*ids.shape, model.config.hidden_size), torch.float32, torch.bfloat16)], casts.shapes


def test_under_bf16_autocast_each_normed_hidden_state_is_cast_once_for_all_its_projections():
    ids = torch.randint(0, 100, (2, 7))
    _, model = _trainer("method=full-backprop", "train.autocast=bf16")
    layers = model.config.num_hidden_layers
    hidden, shapes = _hidden_casts(model, ids)
    # one per norm that feeds projections (attention, MLP) and the final norm's, for the head
    assert hidden == 2 * layers + 1
    # and no bf16 -> fp32 -> bf16 round trip of the MLP's inner activation into down_proj's LoRA
    assert not [kind for kind in shapes if kind[0] == (*ids.shape, model.config.intermediate_size)]
    _, plain = _trainer("method=full-backprop")
    store_frozen_in_bf16(plain)
    # autocast alone: q, k, v, gate, up and their five LoRA A's each cast the same input
    assert _hidden_casts(plain, ids)[0] == 10 * layers + 1 + layers


def test_a_shared_cast_is_reused_only_for_the_same_unchanged_tensor_and_dies_with_it():
    cast_once, layer = _CastOnce(), torch.nn.Identity()
    x = torch.randn(3, 4, requires_grad=True).clone()
    assert cast_once(layer, (x,)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (first,) = cast_once(layer, (x,))
        assert first.dtype == torch.bfloat16 and first.grad_fn is not None
        assert cast_once(layer, (x,))[0] is first
        assert cast_once(layer, (x.clone(),))[0] is not first
        (again,) = cast_once(layer, (x,))
        x.mul_(2)
        (changed,) = cast_once(layer, (x,))
        assert changed is not again and torch.equal(changed, (x * 1).to(torch.bfloat16))
        with torch.no_grad():
            assert cast_once(layer, (x,))[0].grad_fn is None
        assert cast_once(layer, (x.to(torch.bfloat16),)) is None
        with torch.inference_mode():
            assert cast_once(layer, (torch.randn(3, 4),)) is None
    del x, first, again, changed
    assert cast_once.cast is None


@pytest.mark.parametrize("setting", ["lora.dropout=0.1", "lora.backward=mesp"])
def test_lora_layers_with_dropout_or_their_own_backward_keep_autocasts_own_casts(setting):
    """Dropout on a shared bf16 cast would round twice; mesp's fp32 backward needs its fp32 input."""
    ids = torch.randint(0, 100, (2, 7))
    _, model = _trainer("method=full-backprop", "train.autocast=bf16", setting)
    assert _hidden_casts(model.eval(), ids)[0] == 11 * model.config.num_hidden_layers + 1


def _loss_and_lora_grads(model, ids, autocast):
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, params)
    return loss, torch.cat([g.flatten() for g in grads])


def test_the_shared_casts_keep_the_forward_and_the_gradients_as_precise_as_autocast_alone():
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    _, once = _trainer("method=full-backprop", "train.autocast=bf16")
    _, alone = _trainer("method=full-backprop")
    _, reference = _trainer("method=full-backprop")
    store_frozen_in_bf16(alone)
    loss_once, grads_once = _loss_and_lora_grads(once, ids, True)
    loss_alone, grads_alone = _loss_and_lora_grads(alone, ids, True)
    _, grads_fp32 = _loss_and_lora_grads(reference, ids, False)
    assert torch.equal(loss_once, loss_alone)

    def error(grads):
        return ((grads - grads_fp32).norm() / grads_fp32.norm()).item()

    # the readers' bf16 input gradients are summed in bf16 once, not each cast to fp32 first
    assert error(grads_alone) > 0 and error(grads_once) < 1.25 * error(grads_alone)


def _activation_bytes_saved_for_backward(model, ids):
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    return sum(saved.values())


def test_the_shared_casts_save_fewer_bf16_copies_of_the_activations_for_backward():
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    _, once = _trainer("method=full-backprop", "train.autocast=bf16")
    _, alone = _trainer("method=full-backprop")
    store_frozen_in_bf16(alone)
    copy = ids.numel() * once.config.hidden_size * 2
    saved = _activation_bytes_saved_for_backward(alone, ids) - _activation_bytes_saved_for_backward(once, ids)
    # LoRA A saves its input: q, k, v's three copies become one, gate and up's two one, and o_proj's round trip none
    assert saved >= 3 * once.config.num_hidden_layers * copy


def test_k1_stays_full_backprop_bit_for_bit_under_bf16_autocast():
    lcsb, _ = _trainer("method=lcsb", "lcsb.blocks=1", "train.autocast=bf16")
    full, _ = _trainer("method=full-backprop", "train.autocast=bf16")
    for step in range(3):
        assert lcsb.step(step)["loss"] == full.step(step)["loss"]
    for p, q in zip(lcsb.params, full.params):
        assert torch.equal(p, q)


def test_the_chunked_head_under_autocast_matches_the_whole_head():
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 3000, bias=False).requires_grad_(False).to(torch.bfloat16)
    hidden = torch.randn(5, 32, generator=generator, requires_grad=True)
    targets = torch.tensor([0, 17, 1999, 2999, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16), CastCounter(head) as casts:
        chunked = head_cross_entropy(head, hidden, targets)
        (grad,) = torch.autograd.grad(chunked, hidden)
    assert casts.counts["frozen weights"][0] == 0
    whole_hidden = hidden.detach().requires_grad_()
    whole = F.cross_entropy(F.linear(whole_hidden.bfloat16(), head.weight).float(), targets, reduction="sum")
    whole.backward()
    torch.testing.assert_close(chunked, whole, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grad, whole_hidden.grad, rtol=2e-2, atol=2e-3)
