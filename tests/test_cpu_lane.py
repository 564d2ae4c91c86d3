"""npu-sim's CPU lane: every non-frozen operator of a decoder layer billed by its flops and bytes, fused or not."""

import dataclasses
import json

import pytest
import torch
from helpers import LAMP2, run_train

from lcsb_cli.backends.npu_sim.cpu_lane import layer_seconds
from lcsb_cli.backends.npu_sim.device import DeviceModel, load_profile
from lcsb_cli.model.shape import LayerShape
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.engine import build_trainer

TINY_LAYER = LayerShape(hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2)


def one_gigaflop_one_gigabyte() -> DeviceModel:
    profile = dataclasses.replace(load_profile("snapdragon-8gen3"), cpu_gflops=1.0, memory_gbs=1.0)
    return DeviceModel(profile)


@pytest.mark.parametrize("fused,nanoseconds", [(False, 3096), (True, 1152)])
def test_a_tiny_layers_cpu_lane_is_the_sum_of_its_operators_by_hand(fused, nanoseconds):
    """Batch 1 x 3 tokens, fp32 values, 1 GFLOP/s and 1 GB/s: each operator costs max(flops, bytes) ns.
    input norm 12 values: 48 flops, 7 passes x 48 B = 336 (fused 2 passes: 96); RoPE on 3 x 3 heads x 2 = 18
    values: 54 flops, 11 passes = 792 (144); attention products 4 x 18 scores x 2 = 144 flops (144); softmax 18
    values: 90 flops, 6 passes = 432 (144); residual add + norm 12 values: 60 flops, 10 passes = 480 (4: 192);
    SiLU x up 24 values: 120 flops, 8 passes = 768 (3: 288); residual add 12 values: 3 passes = 144 (144)."""
    seconds = layer_seconds(one_gigaflop_one_gigabyte(), TINY_LAYER, batch=1, length=3, fused=fused)
    assert seconds == pytest.approx(nanoseconds * 1e-9)


def test_a_decoder_layer_bills_its_lane_forward_and_twice_that_backward():
    recipe = load_recipe(LAMP2, ["backend=npu-sim", "method=full-backprop", "npu_sim.overlap=false"])
    trainer, loaded, _ = build_trainer(recipe)
    device = trainer.backend.device_model
    batch = trainer.batches.batch(0)
    forward = layer_seconds(device, LayerShape.of(loaded.model.config), *batch["input_ids"].shape, fused=True)
    device.begin_step()
    loaded.model(**batch).logits.sum().backward()
    lane = [cpu for npu, cpu in device._segments if npu == 0]
    layers = len(loaded.layers)
    assert lane.count(pytest.approx(forward)) == layers and lane.count(pytest.approx(2 * forward)) == layers


def test_turning_fusion_off_raises_the_cpu_lane_and_leaves_the_npu_lane(tmp_path):
    lanes = {}
    for fused in (True, False):
        run_train(tmp_path / str(fused), "train.max_steps=2", "backend=npu-sim", f"npu_sim.fuse_cpu_ops={fused}")
        summary = json.loads((tmp_path / str(fused) / "summary.json").read_text())
        lanes[fused] = summary["sim_median_cpu_s"], summary["sim_median_npu_s"], summary["sim_median_step_time_s"]
    assert lanes[False][0] > 1.2 * lanes[True][0] and lanes[False][1] == lanes[True][1]
    assert lanes[False][2] > lanes[True][2]
    assert torch.tensor(lanes[True]).gt(0).all()


def test_the_older_snapdragon_takes_longer_on_both_lanes(tmp_path):
    lanes = {}
    for device in ("snapdragon-8gen3", "snapdragon-8gen2"):
        run_train(tmp_path / device, "train.max_steps=1", "backend=npu-sim", f"npu_sim.device={device}")
        summary = json.loads((tmp_path / device / "summary.json").read_text())
        lanes[device] = summary["sim_median_npu_s"], summary["sim_median_cpu_s"]
    assert all(old > new for old, new in zip(lanes["snapdragon-8gen2"], lanes["snapdragon-8gen3"]))


def test_the_same_step_is_priced_for_a_cpu_trainer_and_a_mobile_gpu_trainer_by_hand():
    """1 GFLOP/s CPU, 1 GB/s memory, a GPU at 10 GFLOP/s x 0.5, no launch cost. A product of 2 GFLOP over 2 MB with
    0.1 GFLOP of adapter work, then a CPU-lane operation of 0.1 GFLOP over 100 MB. CPU trainer: 2 + 0.1 + 0.1 s;
    GPU trainer: 0.4 + 0.02 + 0.1 (memory-bound) s."""
    profile = dataclasses.replace(
        load_profile("snapdragon-8gen3"),
        cpu_gflops=1.0,
        memory_gbs=1.0,
        gpu_fp32_gflops=10.0,
        gpu_efficiency=0.5,
        gpu_launch_us=0.0,
    )
    device = DeviceModel(profile)
    device.product(2e9, 1e6, 1e6, adapter_flops=1e8)
    device.cpu([(1e8, 1e8)])
    metrics, _ = device.end_step()
    assert metrics["sim_cpu_trainer_s"] == pytest.approx(2.2) and metrics["sim_gpu_trainer_s"] == pytest.approx(0.52)
    assert metrics["sim_step_time_s"] < metrics["sim_gpu_trainer_s"] < metrics["sim_cpu_trainer_s"]
