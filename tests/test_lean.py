"""The lean runtime: what a training process imports, and the MeSP LoRA backward."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, run_train

from lcsb_cli.data import build_train_batches, load_task
from lcsb_cli.model.load import load_model
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.model.mesp import MespLinear
from lcsb_cli.recipe import load_recipe

TRAIN_AND_LIST_MODULES = """
import json, sys
from lcsb_cli.cli import app
try:
    app(["train", sys.argv[1], "train.max_steps=1", "train.batch_size=1", "-o", sys.argv[2]])
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.slow
def test_a_training_process_never_loads_the_compiler_or_the_data_and_plotting_stacks(tmp_path):
    """bitsandbytes' import-time torch.compile would load inductor's compiler; datasets (pyarrow, pandas) and
    matplotlib belong to the formats and verbs that use them. The process starts without TORCHDYNAMO_DISABLE in its
    environment: lcsb sets it itself."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run(
        [sys.executable, "-c", TRAIN_AND_LIST_MODULES, str(LAMP2), str(tmp_path / "run")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    modules = set(json.loads(out.stdout.splitlines()[-1]))
    # the path under test really was the training one
    assert "peft" in modules and "bitsandbytes" in modules
    loaded = {name for name in modules if name.split(".")[0] in ("datasets", "pyarrow", "pandas", "matplotlib")}
    assert not loaded
    assert "torch._inductor.compile_fx" not in modules


def lora_grads(backward: str, *overrides: str):
    """Loss and gradients (every LoRA weight, and the embeddings' output) of one batch under lora.backward."""
    recipe = load_recipe(LAMP2, [f"lora.backward={backward}", "lora.rank=8", *overrides])
    loaded = load_model(recipe, torch.device("cpu"))
    # peft starts B at zero, which would leave dA zero on both sides
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    embeddings = []

    def keep_grad(module, args, out):
        out.requires_grad_()
        out.retain_grad()
        embeddings.append(out)

    loaded.model.get_input_embeddings().register_forward_hook(keep_grad)
    batch = build_train_batches(recipe, loaded.tokenizer, load_task(recipe, loaded.tokenizer)).batch(0)
    loss = causal_lm_loss(loaded.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in loaded.model.named_parameters() if p.requires_grad}
    return loss, grads, embeddings[0].grad, loaded.model


@pytest.mark.parametrize("overrides", [(), ("quantization=nf4", "model.dtype=bfloat16")], ids=["fp32", "nf4-bf16"])
def test_mesp_lora_backward_gives_peft_autograd_gradients(overrides):
    loss, grads, input_grad, _ = lora_grads("autograd", *overrides)
    mesp_loss, mesp_grads, mesp_input_grad, model = lora_grads("mesp", *overrides)
    assert sum(isinstance(m, MespLinear) for m in model.modules()) == 4 * 7
    assert torch.equal(loss, mesp_loss)
    assert grads.keys() == mesp_grads.keys() and len(grads) == 2 * 4 * 7
    # bf16 activations: the two sum in different orders
    tolerance = 1e-5 if not overrides else 1e-2
    for name in grads:
        assert torch.allclose(
            grads[name], mesp_grads[name], rtol=tolerance, atol=tolerance * grads[name].abs().max()
        ), name
    assert torch.allclose(input_grad, mesp_input_grad, rtol=tolerance, atol=tolerance * input_grad.abs().max())


def test_mesp_adapters_save_as_plain_peft_ones(tmp_path):
    run_train(tmp_path / "run", "lora.backward=mesp", "train.max_steps=2")
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and len(adapter_tensors(tmp_path / "run")) == 2 * 4 * 7
