"""Real HF models: LCSB gradients against autograd, quantized training, local Llama checkpoints + peft."""

import pytest
import torch
from helpers import LAMP2, adapter_tensors, model_and_first_batch, run_train
from torch import nn

from lcsb_cli.model.load import inference_mode, load_model
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.recipe import load_recipe
from lcsb_cli.rundir import read_metrics
from lcsb_cli.selective import SelectiveLayers, partition


def lora_grads(model: nn.Module) -> dict:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters() if "lora_" in n}


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def per_block_grads(upper_path: str, num_blocks: int):
    """(full-backprop LoRA grads, blocks, [LoRA grads with each block active in turn])."""
    loaded, batch = model_and_first_batch(for_gradients=True)
    causal_lm_loss(loaded.model, batch).backward()
    reference = lora_grads(loaded.model)
    loaded.model.zero_grad(set_to_none=True)
    blocks = partition(len(loaded.layers), num_blocks)
    selective = SelectiveLayers(loaded.layers, blocks, upper_path)
    per_block = []
    for block in range(num_blocks):
        selective.activate(block)
        causal_lm_loss(loaded.model, batch).backward()
        per_block.append(lora_grads(loaded.model))
        loaded.model.zero_grad(set_to_none=True)
    return reference, blocks, per_block


def test_exact_upper_path_equals_full_backprop_gradients_per_block():
    reference, blocks, per_block = per_block_grads("exact", 2)
    for block, grads in enumerate(per_block):
        for name, grad in grads.items():
            if layer_of(name) in blocks[block]:
                torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)
            else:
                assert grad is None, name


def test_identity_path_grads_only_the_active_block_and_top_block_is_exact():
    reference, blocks, per_block = per_block_grads("identity", 4)
    for block, grads in enumerate(per_block):
        for name, grad in grads.items():
            if layer_of(name) in blocks[block]:
                assert grad is not None and grad.abs().sum() > 0, name
                # nothing above the top block: the surrogate is the true gradient
                if block == 3:
                    torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)
            else:
                assert grad is None, name


@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_quantized_runs_train(tmp_path, quant):
    run_train(tmp_path / quant, f"quantization={quant}", "train.max_steps=4", "lcsb.blocks=2")
    rows = read_metrics(tmp_path / quant / "metrics.jsonl")
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    tensors = adapter_tensors(tmp_path / quant)
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)


def _linear4bit(model):
    from bitsandbytes.nn import Linear4bit

    return next(m for m in model.modules() if isinstance(m, Linear4bit))


def test_4bit_model_keeps_every_lora_gradient_after_evaluation():
    loaded, batch = model_and_first_batch("quantization=nf4", for_gradients=True)
    with inference_mode(loaded.model):
        loaded.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert not getattr(_linear4bit(loaded.model).weight.quant_state, "packing_format_for_cpu", False)
    loaded.model.train()
    causal_lm_loss(loaded.model, batch).backward()
    grads = lora_grads(loaded.model)
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_plain_eval_forward_would_repack_4bit_weights():
    """Documents the bitsandbytes hazard inference_mode exists for (on CPUs with AVX512-BF16)."""
    loaded, batch = model_and_first_batch("quantization=nf4", for_gradients=True)
    if not _linear4bit(loaded.model).support_avx512bf16_for_cpu:
        pytest.skip("bitsandbytes repacks only on CPUs with AVX512-BF16")
    loaded.model.eval()
    with torch.no_grad():
        loaded.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert getattr(_linear4bit(loaded.model).weight.quant_state, "packing_format_for_cpu", False)


ARCHITECTURES = ["llama", "qwen3", "mistral", "gemma"]


def save_checkpoint_dir(path, model_type: str):
    """A tiny random model of `model_type` saved the way users save theirs (save_pretrained + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lcsb_cli.model.load import TOKENIZER_DIR

    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=2048,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR / "lcsb-bpe").save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_local_checkpoint_trains_and_adapter_loads_in_plain_peft(tmp_path, model_type):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = save_checkpoint_dir(tmp_path / model_type, model_type)
    run_dir = tmp_path / "run"
    run_train(run_dir, f"model.name={base_dir}", "train.max_steps=4", "lcsb.blocks=2")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["active_block"] for r in rows] == [0, 1, 0, 1]
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        before = base(ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, run_dir / "adapter")
        after = tuned(ids).logits
    assert not torch.allclose(before, after)


def test_trust_remote_code_is_off_by_default_and_warns_when_turned_on():
    recipe = load_recipe(LAMP2, [])
    assert recipe.model.trust_remote_code is False
    with pytest.warns(UserWarning, match="trust_remote_code is on"):
        load_model(load_recipe(LAMP2, ["model.trust_remote_code=true"]), torch.device("cpu"))
