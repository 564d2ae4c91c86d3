"""npu-sim: the NPU's interface and numerics against fp32 references, the device model, and training on it."""

import json
from itertools import pairwise

import pytest
import torch
from helpers import adapter_tensors, assert_same_tensors, run_train

from lcsb_cli.backends.npu_sim import NpuSimBackend
from lcsb_cli.backends.npu_sim.device import DeviceModel, load_profile
from lcsb_cli.backends.npu_sim.executor import Calibration, NpuExecutor, dequantize, from_fp16, to_fp16
from lcsb_cli.recipe.schema import NpuSimConfig

FORMATS = ("fp16", "int8", "int4")
# relative error of the product against the fp32 weights
TOLERANCE = {"fp16": 2e-3, "int8": 2e-2, "int4": 0.2}


def _weight(out_features=96, in_features=64, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_gradient_matches_fp32_reference(fmt):
    weight = _weight()
    npu = NpuExecutor(fmt, overlap=False)
    res = npu.load("w", weight)
    grad = torch.randn(5, 7, 96) * 1e-3
    effective = dequantize(res, slice(None), torch.float32)
    # FP16 rounding of the same weights
    assert _rel(npu.input_grad(grad, res), grad @ effective) < 2e-3
    # plus the quantization error
    assert _rel(npu.input_grad(grad, res), grad @ weight) < TOLERANCE[fmt]
    x = torch.randn(5, 7, 64)
    assert _rel(npu.forward(x, res), x @ weight.T) < TOLERANCE[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_and_input_gradient_read_identical_weights(fmt):
    """Products with identity inputs expose the effective weights each kernel used: they are bit-identical."""
    npu = NpuExecutor(fmt, overlap=False)
    # more rows than one tile
    res = npu.load("w", _weight(300, 64))
    seen_by_forward = npu.forward(torch.eye(64), res).T
    seen_by_input_grad = npu.input_grad(torch.eye(300), res)
    assert torch.equal(seen_by_forward, seen_by_input_grad)


@pytest.mark.parametrize("fmt,bytes_per_weight", [("fp16", 2), ("int8", 1), ("int4", 0.5)])
def test_resident_bytes_are_the_quantized_weights_only(fmt, bytes_per_weight):
    npu = NpuExecutor(fmt, overlap=False)
    res = npu.load("w", _weight(96, 64))
    # fp16 scales: per row, per group of 32
    scales = {"fp16": 0, "int8": 96 * 2, "int4": 96 * 2 * 2}[fmt]
    assert npu.resident_bytes() == 96 * 64 * bytes_per_weight + scales
    assert res.codes.dtype != torch.float32


def test_row_protection_keeps_rows_plain_fp16_loses():
    rows = torch.tensor([[3e-9, -1e-9, 2e-9, 5e-10], [0.5, -0.25, 0.1, 0.3], [9e4, -7e4, 1e5, 3e4]])
    protected = from_fp16(*to_fp16(rows, protect=True))
    plain = from_fp16(*to_fp16(rows, protect=False))
    for i in range(3):
        assert _rel(protected[i], rows[i]) < 1e-3
    # a row already in range is unchanged, bit for bit
    assert torch.equal(protected[1], plain[1].float())
    # flushed to zero
    assert torch.count_nonzero(plain[0]) == 0
    # overflowed
    assert not torch.isfinite(plain[2]).all()


def test_tiny_gradients_survive_the_npu_product_only_with_protection():
    weight = _weight()
    grad = torch.randn(8, 96) * 1e-9
    reference = grad @ weight
    protected = NpuExecutor("fp16", row_protection=True, overlap=False)
    plain = NpuExecutor("fp16", row_protection=False, overlap=False)
    assert _rel(protected.input_grad(grad, protected.load("w", weight)), reference) < 2e-3
    assert torch.count_nonzero(plain.input_grad(grad, plain.load("w", weight))) == 0
    assert protected.protected_rows == 8


def test_calibration_moves_layers_whose_fp16_gradient_is_off_to_fp32():
    npu = NpuExecutor("fp16", row_protection=False, overlap=False)
    npu.calibration = Calibration()
    safe, tiny = npu.load("safe", _weight(seed=1)), npu.load("tiny", _weight(seed=2))
    npu.input_grad(torch.randn(4, 96) * 1e-2, safe)
    npu.input_grad(torch.randn(4, 96) * 1e-8, tiny)
    assert npu.calibration.choose(0.01) == {"safe": "fp16", "tiny": "fp32"}
    tiny.precision = "fp32"
    grad = torch.randn(4, 96) * 1e-8
    assert _rel(npu.input_grad(grad, tiny), grad @ dequantize(tiny, slice(None), torch.float32)) < 1e-6


def _hot_profile(tmp_path):
    profile = load_profile("snapdragon-8gen3").__dict__ | {
        "skin_heat_capacity_j_per_c": 0.5,
        "soc_heat_capacity_j_per_c": 0.01,
    }
    path = tmp_path / "hot.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in profile.items() if k != "name"))
    return load_profile(str(path))


def test_thermal_model_throttles_a_long_hot_run_and_recovers_when_cooled(tmp_path):
    device = DeviceModel(_hot_profile(tmp_path))
    # flops, weight bytes, activation bytes of one product
    work = (1e12, 1e6, 1e6)
    cool_time = device.npu_seconds(*work)
    events = []
    for _ in range(200):
        device.begin_step()
        device.product(*work, adapter_flops=1e10)
        events += device.end_step()[1]
    assert (
        events == ["npu_clock_throttled"] and device.temp_c >= device.profile.throttle_c - device.profile.hysteresis_c
    )
    # clock halved
    assert device.npu_seconds(*work) > 1.9 * cool_time - device.profile.npu_launch_us * 1e-6
    assert device.throttled_s > 0
    assert device.advance(60.0, device.profile.idle_power_w) == ["npu_clock_restored"]
    assert device.npu_seconds(*work) == cool_time


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_on_npu_sim_tracks_the_cpu_backend_and_reports_the_device(tmp_path):
    run_train(tmp_path / "cpu", "train.max_steps=4")
    run_train(tmp_path / "npu", "train.max_steps=4", "backend=npu-sim")
    cpu = [r["loss"] for r in _rows(tmp_path / "cpu") if "loss" in r]
    rows = _rows(tmp_path / "npu")
    steps = [r for r in rows if "loss" in r]
    assert all(abs(n["loss"] - c) / c < 0.02 for n, c in zip(steps, cpu))
    for row in steps:
        assert row["sim_step_time_s"] > 0 and row["sim_energy_j"] > 0 and 0 < row["npu_util"] <= 1
    assert [r["fp32_layers"] for r in rows if r.get("event") == "precision"] == [[]]


def _heat_balance_holds(profile, before, after, energy_j, seconds):
    """Energy balance of the two nodes, (soc, skin) temperatures before and after: the heat they stored equals E
    minus what the skin lost to ambient meanwhile, which lies between its leak rates at the interval's two ends
    times its length (the skin's temperature moves one way within it)."""
    leak = sorted(
        (skin - profile.ambient_c) / profile.skin_to_ambient_c_per_w * seconds for skin in (before[1], after[1])
    )
    stored = profile.soc_heat_capacity_j_per_c * (after[0] - before[0]) + profile.skin_heat_capacity_j_per_c * (
        after[1] - before[1]
    )
    return energy_j - leak[1] - 1e-9 <= stored <= energy_j - leak[0] + 1e-9


def test_each_steps_energy_heats_the_phone_by_its_heat_capacity_and_idling_cools_it(tmp_path):
    run_train(tmp_path / "npu", "train.max_steps=4", "backend=npu-sim")
    steps = [r for r in _rows(tmp_path / "npu") if "loss" in r]
    profile = load_profile("snapdragon-8gen3")
    temps = [(profile.ambient_c, profile.ambient_c)] + [(r["sim_soc_temp_c"], r["sim_temp_c"]) for r in steps]
    # energy spent, far below steady state
    assert all(after[1] > before[1] for before, after in pairwise(temps))
    for before, after, row in zip(temps, temps[1:], steps):
        assert _heat_balance_holds(profile, before, after, row["sim_energy_j"], row["sim_step_time_s"])
    backend = NpuSimBackend(NpuSimConfig())
    hot = {"thermal": {"soc_c": 40.0, "skin_c": 40.0, "throttled": False}, "throttled_s": 0}
    backend.load_state_dict({**backend.state_dict(), "device": hot})
    assert backend.idle(60.0) and backend.temperature() < 40.0
    thermal = backend.device_model.thermal
    assert _heat_balance_holds(profile, (40.0, 40.0), (thermal.soc_c, thermal.skin_c), profile.idle_power_w * 60, 60)
    # idle 5 h (over 30 skin time constants): down to where the idle floor balances the leak
    for _ in range(5):
        backend.idle(3600.0)
    assert backend.temperature() == pytest.approx(
        profile.ambient_c + profile.idle_power_w * profile.skin_to_ambient_c_per_w, abs=0.01
    )
    assert not backend.idle(60.0)
    backend.executor.close()


def test_no_fp32_weight_copy_and_resident_bytes_fixed_while_training(tmp_path):
    from helpers import LAMP2

    from lcsb_cli.recipe import load_recipe
    from lcsb_cli.run.engine import build_trainer

    trainer, loaded, _ = build_trainer(load_recipe(LAMP2, ["backend=npu-sim", "train.max_steps=2"]))
    base = [
        m.weight
        for m in loaded.model.modules()
        if isinstance(m, torch.nn.Linear)
        and not m.weight.requires_grad
        and m is not loaded.model.get_output_embeddings()
    ]
    # the CPU side keeps no copy of any frozen layer weight
    assert base and all(w.is_meta for w in base)
    npu = trainer.backend.executor
    # int8 codes + fp16 scales
    expected = sum(r.shape[0] * r.shape[1] + 2 * r.shape[0] for r in npu.residents)
    before = npu.resident_bytes()
    assert before == expected
    for step in range(2):
        trainer.step(step)
    assert npu.resident_bytes() == before
    # the memory breakdown counts the resident tiles as weights and the meta placeholders as nothing
    from lcsb_cli.model.memory import breakdown, frozen_tensors

    on_cpu = sum(t.nbytes for t in frozen_tensors(loaded.model) if not t.is_meta)
    figures = breakdown(loaded.model, loaded.probe, 0.0, trainer.backend.held_weights())
    assert figures["weights_mb"] == pytest.approx((on_cpu + before) / 2**20, abs=0.05)


def test_overlapped_npu_equals_serial_execution(tmp_path):
    run_train(tmp_path / "overlap", "train.max_steps=3", "backend=npu-sim", "npu_sim.overlap=true")
    run_train(tmp_path / "serial", "train.max_steps=3", "backend=npu-sim", "npu_sim.overlap=false")
    assert_same_tensors(adapter_tensors(tmp_path / "overlap"), adapter_tensors(tmp_path / "serial"))
    overlap, serial = _rows(tmp_path / "overlap"), _rows(tmp_path / "serial")
    assert [r.get("loss") for r in overlap] == [r.get("loss") for r in serial]
    idle_w = load_profile("snapdragon-8gen3").idle_power_w
    for o, s in ((o, s) for o, s in zip(overlap, serial) if "loss" in o):
        # the NPU lane's busy time: the same products in both runs
        npu = s["npu_util"] * s["sim_step_time_s"]
        # serial: the lanes take turns, so the CPU lane has the rest
        cpu = s["sim_step_time_s"] - npu
        assert o["npu_util"] * o["sim_step_time_s"] == pytest.approx(npu, rel=1e-9)
        # no lane finishes faster than its work
        assert max(npu, cpu) <= o["sim_step_time_s"] < s["sim_step_time_s"]
        # the same busy work on each unit: overlap saves only the idle floor's energy over the time it saves
        saved_j = idle_w * (s["sim_step_time_s"] - o["sim_step_time_s"])
        assert s["sim_energy_j"] - o["sim_energy_j"] == pytest.approx(saved_j, rel=1e-6)


def test_precision_threshold_zero_moves_every_layer_to_fp32(tmp_path):
    run_train(
        tmp_path / "run",
        "train.max_steps=5",
        "backend=npu-sim",
        "npu_sim.fp32_threshold=0",
        "npu_sim.calibration_steps=4",
    )
    (choice,) = [r for r in _rows(tmp_path / "run") if r.get("event") == "precision"]
    # one cycle of K=4 one-layer blocks: each active layer's input gradients pass o, gate, up and down; q, k and v
    # need none (the layer's input comes from the no-grad layers below)
    assert choice["step"] == 4 and len(choice["fp32_layers"]) == 4 * 4
    # the calibrated layers, by what they need
    assert choice["calibrated"] == {"fp32": choice["fp32_layers"]}


def test_npu_sim_resume_is_exact_including_the_device_state(tmp_path):
    # no schedule tied to max_steps
    same = ("train.save_every=2", "backend=npu-sim", "train.lr_scheduler=constant")
    run_train(tmp_path / "whole", "train.max_steps=4", *same)
    run_train(tmp_path / "split", "train.max_steps=2", *same)
    run_train(tmp_path / "split", "train.max_steps=4", *same, resume=True)
    assert_same_tensors(adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split"))
    keys = ("loss", "sim_temp_c", "sim_energy_j")
    whole = [[r.get(k) for k in keys] for r in _rows(tmp_path / "whole") if "loss" in r]
    split = [[r.get(k) for k in keys] for r in _rows(tmp_path / "split") if "loss" in r]
    assert whole == split


@pytest.mark.parametrize("spread,chosen", [(1e5, "fp16"), (1e6, "fp32")])
def test_auto_precision_moves_a_layer_with_outlier_rows_to_fp32_only_when_fp16_is_really_off(spread, chosen):
    """Two output channels whose weight rows are `spread` times smaller than the rest and whose gradients are
    `spread` times larger: each gradient row spans `spread`, so row protection, scaling the row to its outliers,
    pushes the ordinary entries toward FP16's subnormals. At 1e5 fp16 stays within 0.2 %; at 1e6 it is off by
    over 1 % and calibration moves the layer to fp32, while a plain layer stays fp16."""
    outlier = _weight(seed=0)
    outlier[:2] /= spread
    npu = NpuExecutor("int8", overlap=False)
    residents = [npu.load("plain", _weight(seed=1)), npu.load("outlier", outlier)]
    npu.calibration = Calibration()
    grad = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    grad[:, :2] *= spread
    for resident in residents:
        npu.input_grad(grad, resident)
    assert npu.calibration.choose(0.01) == {"plain": "fp16", "outlier": chosen}
