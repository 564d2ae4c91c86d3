"""PackedLinear: a frozen linear over GGUF blocks, dequantized per call, against nn.Linear holding the dequantized
weight. Float32 results are compared with torch.equal: both run the same F.linear on the same float32 weight in
forward and the same `grad @ W` product in backward, so any difference is a bug, not rounding."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_gguf_quants import random_blocks
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lcsb_cli.errors import BadInput
from lcsb_cli.model.gguf.linear import PackedLinear, from_gguf_tensor

T = gguf.GGMLQuantizationType
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_packed(qtype: T, rows: int, blocks_per_row: int, bias: bool = True, **kwargs) -> PackedLinear:
    cols = blocks_per_row * gguf.GGML_QUANT_SIZES[qtype][0]
    packed = torch.from_numpy(random_blocks(qtype, rows, cols, seed=rows + cols))
    return PackedLinear(packed, qtype, cols, torch.randn(rows) if bias else None, **kwargs)


def plain_copy(packed: PackedLinear) -> nn.Linear:
    """nn.Linear with the dequantized weight and the same bias, frozen."""
    linear = nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(packed.dequantized_weight())
        if packed.bias is not None:
            linear.bias.copy_(packed.bias)
    return linear.requires_grad_(False)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda qtype: qtype.name)
def test_forward_and_input_gradient_equal_nn_linear(qtype):
    torch.manual_seed(0)
    packed = random_packed(qtype, 24, 2)
    plain = plain_copy(packed)
    x = torch.randn(3, 5, packed.in_features, requires_grad=True)
    y, y_plain = packed(x), plain(x)
    assert torch.equal(y, y_plain)
    grad = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, grad)
    (grad_x_plain,) = torch.autograd.grad(y_plain, x, grad)
    assert torch.equal(grad_x, grad_x_plain)
    assert not any(p.requires_grad for p in packed.parameters())
    assert packed.weight.dtype == torch.uint8 and packed.weight.grad is None


def test_a_trainable_bias_gets_the_gradient_nn_linear_gives_it():
    torch.manual_seed(0)
    packed = random_packed(T.Q4_K, 16, 1)
    plain = plain_copy(packed)
    packed.bias.requires_grad_(True)
    plain.bias.requires_grad_(True)
    x = torch.randn(4, 7, packed.in_features)
    grad = torch.randn(4, 7, packed.out_features)
    packed(x).backward(grad)
    plain(x).backward(grad)
    assert torch.equal(packed.bias.grad, plain.bias.grad)


def test_the_graph_keeps_the_blocks_only_never_a_float_weight_or_the_input():
    packed = random_packed(T.Q8_0, 64, 4)
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.untyped_storage().data_ptr()))
        return tensor

    x = torch.randn(2, 3, packed.in_features, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        packed(x).sum().backward()
        assert saved == [(torch.uint8, packed.weight.untyped_storage().data_ptr())]
        saved.clear()
        y = packed(x.detach())
        with torch.no_grad():
            y_no_grad = packed(x)
    assert saved == [] and y.grad_fn is None and y_no_grad.grad_fn is None
    assert torch.equal(packed(x), y) and torch.equal(y_no_grad, y)


def test_the_blocks_are_a_buffer_outside_the_state_dict_that_float_casts_leave_alone():
    packed = random_packed(T.Q4_0, 8, 1)
    assert "weight" not in packed.state_dict() and "bias" in packed.state_dict()
    packed.to(torch.bfloat16)
    assert packed.weight.dtype == torch.uint8 and packed.bias.dtype == torch.bfloat16


def test_bf16_compute_stays_within_bf16_rounding_and_returns_the_input_dtype():
    torch.manual_seed(0)
    packed = random_packed(T.Q6_K, 32, 2, compute_dtype=torch.bfloat16)
    plain = plain_copy(packed)
    x = torch.randn(2, 6, packed.in_features, requires_grad=True)
    y, y_plain = packed(x), plain(x)
    assert y.dtype == torch.float32 and not torch.equal(y, y_plain)
    # bf16 keeps 8 significant bits: x and W each round by up to 2^-9, so 1% of the largest value bounds the error
    torch.testing.assert_close(y, y_plain, rtol=0, atol=1e-2 * y_plain.abs().max().item())
    grad = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, grad)
    (grad_x_plain,) = torch.autograd.grad(y_plain, x, grad)
    assert grad_x.dtype == torch.float32
    torch.testing.assert_close(grad_x, grad_x_plain, rtol=0, atol=1e-2 * grad_x_plain.abs().max().item())


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_under_bf16_autocast_forward_and_input_gradient_equal_nn_linear(compute_dtype):
    """Autocast runs the forward's product in bf16, so the gradient arrives in bf16: backward dequantizes in it."""
    torch.manual_seed(0)
    packed = random_packed(T.Q4_K, 16, 1, compute_dtype=compute_dtype)
    plain = plain_copy(packed)
    x = torch.randn(2, 3, packed.in_features, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_plain = packed(x), plain(x)
    assert torch.equal(y.float(), y_plain.float())
    grad = torch.randn_like(y_plain)
    (grad_x,) = torch.autograd.grad(y, x, grad.to(y.dtype))
    (grad_x_plain,) = torch.autograd.grad(y_plain, x, grad)
    assert grad_x.dtype == torch.float32 and torch.equal(grad_x, grad_x_plain)


def packed_llama() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny Llama whose decoder projections are PackedLinear (attention Q4_0, MLP Q8_0, quantized from its own
    random weights) and its twin holding the dequantized weights in plain nn.Linear."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    plain = copy.deepcopy(model)
    for layer, plain_layer in zip(model.model.layers, plain.model.layers):
        for block in ("self_attn", "mlp"):
            qtype = T.Q4_0 if block == "self_attn" else T.Q8_0
            for name, linear in list(getattr(layer, block).named_children()):
                if not isinstance(linear, nn.Linear):
                    continue
                blocks = gguf.quants.quantize(linear.weight.detach().numpy(), qtype)
                packed = PackedLinear(torch.from_numpy(blocks), qtype, linear.in_features)
                setattr(getattr(layer, block), name, packed)
                getattr(plain_layer, block).get_submodule(name).weight.data = packed.dequantized_weight()
    return model, plain


def lora(model: nn.Module, targets: list[str]) -> nn.Module:
    # init_lora_weights=False: B is random too, so every adapter gets a non-zero gradient
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def test_peft_lora_over_packed_projections_trains_as_over_plain_ones():
    model, plain = packed_llama()
    model, plain = lora(model, PROJECTIONS), lora(plain, PROJECTIONS)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, PackedLinear)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    loss, plain_loss = model(ids, labels=ids).loss, plain(ids, labels=ids).loss
    assert torch.equal(loss, plain_loss)
    loss.backward()
    plain_loss.backward()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    plain_adapters = dict(plain.named_parameters())
    assert len(adapters) == 2 * len(PROJECTIONS) * 2
    for name, param in adapters.items():
        assert "lora_" in name and param.dtype == torch.float32
        assert param.grad.abs().sum() > 0, name
        assert torch.equal(param.grad, plain_adapters[name].grad), name


def test_peft_keeps_float32_adapters_over_a_bf16_packed_layer():
    wrapper = nn.Sequential()
    wrapper.add_module("proj", random_packed(T.Q4_K, 16, 1, compute_dtype=torch.bfloat16))
    model = lora(wrapper, ["proj"])
    proj = model.base_model.model.proj
    assert proj.lora_A["default"].weight.dtype == torch.float32
    assert proj.lora_B["default"].weight.dtype == torch.float32
    model(torch.randn(3, 256)).sum().backward()
    assert proj.lora_A["default"].weight.grad.abs().sum() > 0


def write_gguf(path, tensors: dict[str, np.ndarray], qtypes: dict[str, T]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(path, "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtypes.get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_from_gguf_tensor_reads_rows_by_cols_and_applies_the_row_order(tmp_path):
    weight = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    tensors = {
        "q8": gguf.quants.quantize(weight, T.Q8_0),
        "f16": weight.astype(np.float16),
        "f32": weight,
    }
    reader = write_gguf(tmp_path / "t.gguf", tensors, {"q8": T.Q8_0})
    rows = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(12)
    for tensor in reader.tensors:
        expected = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        packed = from_gguf_tensor(tensor)
        assert (packed.out_features, packed.in_features) == (12, 64)
        assert torch.equal(packed.dequantized_weight(), expected)
        assert packed.weight.untyped_storage().data_ptr() != tensor.data.ctypes.data
        permuted = from_gguf_tensor(tensor, rows=rows, bias=bias)
        assert torch.equal(permuted.dequantized_weight(), expected[rows])
        assert torch.equal(permuted.bias, bias[rows])


def test_from_gguf_tensor_refuses_a_bad_row_order_and_a_1d_tensor(tmp_path):
    reader = write_gguf(tmp_path / "t.gguf", {"w": np.ones((4, 32), np.float32), "norm": np.ones(32, np.float32)}, {})
    weight, norm = reader.tensors
    with pytest.raises(BadInput, match=r"^w: the row order must be a permutation of its 4 output rows$"):
        from_gguf_tensor(weight, rows=torch.tensor([0, 1, 1, 3]))
    with pytest.raises(BadInput, match=r"^norm: a linear weight has 2 dimensions, this GGUF tensor has 1$"):
        from_gguf_tensor(norm)
