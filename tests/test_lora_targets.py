"""lora.targets' default, all-linear: every linear layer of the decoder (peft's rule, the LM head excluded). Where a
layer is the seven projections (lamp-tiny, Qwen2, Llama) it adapts what the seven names did; on Phi-3 (fused qkv_proj
and gate_up_proj), where the seven names exit 2, it trains."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import LAMP2, assert_one_line_error, cli, run_train
from tiny_families import tiny_checkpoint

from lcsb_cli.bench.roofline import ModelShape
from lcsb_cli.model.load import load_model
from lcsb_cli.recipe import load_recipe
from lcsb_cli.recipe.schema import LoraConfig

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(recipe) -> tuple[list[str], list[str]]:
    """The modules that got LoRA, and the target names peft recorded for the adapter."""
    model = load_model(recipe, torch.device("cpu")).model
    modules = sorted(name.removesuffix(".lora_A") for name, _ in model.named_modules() if name.endswith(".lora_A"))
    return modules, sorted(model.peft_config["default"].target_modules)


@pytest.mark.parametrize("arch", ["lamp-tiny", "qwen2", "llama"])
def test_the_default_adapts_the_seven_projections_where_a_layer_has_them(arch, tmp_path):
    name = {"lamp-tiny": "lamp-tiny", "qwen2": "tiny-qwen2"}.get(arch) or tiny_checkpoint(tmp_path / arch, arch)
    default = load_recipe(LAMP2, [f"model.name={name}", f"lora.targets={LoraConfig().targets}"])
    assert default.lora.targets == ["all-linear"]
    modules, recorded = adapted(default)
    assert (modules, recorded) == adapted(load_recipe(LAMP2, [f"model.name={name}", f"lora.targets={SEVEN}"]))
    assert recorded == sorted(SEVEN) and not any("lm_head" in module for module in modules)
    config = load_model(default, torch.device("cpu")).model.config
    assert ModelShape.of(config, default) == ModelShape.of(config, load_recipe(LAMP2, [f"model.name={name}"]))


def test_phi3_trains_with_the_default_and_the_seven_names_are_refused(tmp_path):
    phi3 = tiny_checkpoint(tmp_path / "phi3", "phi3")
    summary = run_train(
        tmp_path / "run", f"model.name={phi3}", f"lora.targets={LoraConfig().targets}", "train.max_steps=1"
    )
    assert summary["steps"] == 1 and not summary["diverged"]
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    # peft records full module names below 20 of them
    leaves = {name.rsplit(".", 1)[-1] for name in config["target_modules"]}
    assert sorted(leaves) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    result = cli("train", str(LAMP2), f"model.name={phi3}", "--output", str(tmp_path / "seven"))
    assert_one_line_error(result, "lora.targets", "q_proj", "not found", "qkv_proj", "gate_up_proj")
    assert not (tmp_path / "seven").exists()


def test_all_linear_goes_alone():
    result = cli("validate", str(LAMP2), "lora.targets=[all-linear, q_proj]")
    assert_one_line_error(result, "lora.targets", "all-linear", "alone")
