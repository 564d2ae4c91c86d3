"""npu-htp: products on Qualcomm's HTP kernels (emulated) against npu-sim and fp32, its trap, recovery and training."""

import json

import pytest
import torch
from helpers import LAMP2, REPO, adapter_tensors, assert_one_line_error, assert_same_tensors, cli, run_train
from safetensors.torch import load_file

pytest.importorskip("onnxruntime_qnn", reason="the npu extra: pip install -e '.[npu]'")

from lcsb_cli.backends import qdq
from lcsb_cli.backends.npu_htp import session as htp_session
from lcsb_cli.backends.npu_htp.executor import HtpExecutor, ModeCalibration
from lcsb_cli.backends.npu_htp.graphs import product_graph
from lcsb_cli.backends.npu_sim.executor import NpuExecutor, dequantize

LAMP_TINY = REPO / "recipes" / "lamp2.yaml"
# the emulator runs ~0.1-1 GFLOP/s: keep products small
SHORT = ("data.max_length=80", "train.batch_size=1")
# int8 weights (~0.7 %) plus the activations' rounding
RELATIVE_TO_FP32 = {"w8a16": 1e-2, "fp16": 1e-2, "w8a8": 0.1}


def _lamp_tiny_weights(*names):
    (path,) = (REPO / "configs" / "models" / "lamp-tiny").glob("*.safetensors")
    weights = load_file(path)
    return {name: weights[f"model.layers.3.{name}.weight"].float() for name in names}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("contract_rows", [False, True], ids=["forward", "input-grad"])
def test_htp_products_equal_npu_sim_within_one_step_and_fp32_within_the_stated_error(contract_rows):
    """On lamp-tiny's real weights: each QDQ product within one output step of npu-sim's emulation of the same graph,
    fp16 within fp16 rounding of npu-sim's fp16 product, all close to fp32 over the original weights; HTP repeats
    itself bit for bit."""
    htp, sim = HtpExecutor(75, 57, overlap=False), NpuExecutor("int8", overlap=False)
    generator = torch.Generator().manual_seed(0)
    for name, weight in _lamp_tiny_weights("self_attn.k_proj", "mlp.down_proj").items():
        on_htp, on_sim = htp.load(name, weight), sim.load(name, weight)
        rows = torch.randn(100, weight.shape[0] if contract_rows else weight.shape[1], generator=generator)
        exact = rows @ weight if contract_rows else rows @ weight.T
        for precision in ("w8a16", "w8a8", "fp16"):
            on_htp.precision = on_sim.precision = precision
            product = htp.input_grad if contract_rows else htp.forward
            out = product(rows, on_htp)
            # deterministic
            assert torch.equal(out, product(rows, on_htp))
            expected = (sim.input_grad if contract_rows else sim.forward)(rows, on_sim)
            assert _rel(out, exact) < RELATIVE_TO_FP32[precision], (name, precision)
            if precision == "fp16":
                assert _rel(out, expected) < 1e-3
                continue
            scaled, _ = qdq.npu_rows(rows, on_htp.scales, contract_rows)
            graph_out = torch.from_numpy(htp.graph(on_htp, precision, contract_rows).run(scaled.numpy()))
            step = qdq.output_range(on_htp.codes, precision, contract_rows) / qdq.ACT_LEVELS[precision]
            assert (graph_out - qdq.emulate(scaled, on_htp.codes, precision, contract_rows)).abs().max() <= step * 1.001


def test_per_channel_scales_in_the_transposed_graph_are_the_trap_folding_avoids():
    """HTP accepts a per-output-channel DequantizeLinear read transposed (the scales then sit on the summed dimension)
    and returns garbage without a message; folding the scales into the gradient and reading unit-scale codes is
    right."""
    executor = HtpExecutor(75, 57, overlap=False)
    # [768, 256]
    weight = _lamp_tiny_weights("mlp.up_proj")["mlp.up_proj"]
    # an outlier channel, as real LLM weights have: the channel scales differ widely
    weight[7] *= 30
    resident = executor.load("down", weight)
    grad = torch.randn(64, weight.shape[0], generator=torch.Generator().manual_seed(1))
    exact = grad @ dequantize(resident, slice(None), torch.float32)
    scaled, exponents = qdq.npu_rows(grad, torch.ones_like(resident.scales), contract_rows=True)
    naive = product_graph(
        resident.codes.numpy(),
        64,
        "w8a16",
        True,
        float((resident.codes.float() * resident.scales.float()).abs().sum(0).max()),
        weight_scales=resident.scales.float().flatten().numpy(),
    )
    out = htp_session.HtpGraph("naive", naive, htp_session.provider_options(75, 57)).run(scaled.numpy())
    assert _rel(torch.ldexp(torch.from_numpy(out), exponents), exact) > 0.3
    assert _rel(executor.input_grad(grad, resident), exact) < 1e-3


def test_a_failed_run_is_retried_once_then_the_layer_falls_back_to_the_cpu_lane(monkeypatch):
    executor = HtpExecutor(75, 57, overlap=False)
    resident = executor.load("0.mlp.up_proj", torch.randn(64, 32, generator=torch.Generator().manual_seed(2)))
    resident.precision = "w8a16"
    rows = torch.randn(10, 32)
    clean = executor.forward(rows, resident)
    graph = executor.graph(resident, "w8a16", False)
    real_run, faults = graph.session.run, iter([RuntimeError("injected")])

    def fails_once(*args):
        fault = next(faults, None)
        if fault is not None:
            raise fault
        return real_run(*args)

    monkeypatch.setattr(graph.session, "run", fails_once)
    # rebuilt from the cache and retried
    assert torch.equal(executor.forward(rows, resident), clean)
    assert executor.take_fallbacks() == [] and resident.precision == "w8a16"
    monkeypatch.setattr(
        htp_session.HtpGraph,
        "_run_block",
        lambda self, block: (_ for _ in ()).throw(htp_session.HtpError(f"{self.name}: injected")),
    )
    out = executor.forward(rows, resident)
    assert torch.allclose(out, rows @ dequantize(resident, slice(None), torch.float32).T, atol=1e-6)
    assert executor.take_fallbacks() == ["0.mlp.up_proj"] and resident.precision == "fp32"
    # calibration tries three graphs a gradient
    resident.precision, executor.calibration = "w8a16", ModeCalibration()
    grad = torch.randn(10, 64)
    assert torch.allclose(executor.input_grad(grad, resident), grad @ dequantize(resident, slice(None), torch.float32))
    # reported once
    assert executor.take_fallbacks() == ["0.mlp.up_proj"]


@pytest.mark.slow
def test_training_on_npu_htp_tracks_cpu_and_a_failing_layer_falls_back_with_an_event(tmp_path, monkeypatch):
    run_train(tmp_path / "cpu", "train.max_steps=6", *SHORT)
    real = htp_session.HtpGraph._run_block

    def broken_o_proj(self, block):
        if self.name.startswith("layer 1.self_attn.o_proj"):
            raise htp_session.HtpError(f"{self.name}: injected")
        return real(self, block)

    monkeypatch.setattr(htp_session.HtpGraph, "_run_block", broken_o_proj)
    run_train(tmp_path / "htp", "train.max_steps=6", "backend=npu-htp", *SHORT)
    cpu = [r["loss"] for r in _rows(tmp_path / "cpu") if "loss" in r]
    rows = _rows(tmp_path / "htp")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6 and all(abs(h - c) / c < 0.02 for h, c in zip(losses, cpu))
    assert [r["layer"] for r in rows if r.get("event") == "npu_fallback"] == ["1.self_attn.o_proj"]
    (choice,) = [r for r in rows if r.get("event") == "precision"]
    assert "1.self_attn.o_proj" in choice["fp32_layers"] and choice["precisions"]["w8a16"] > 0
    assert set(choice["max_relative_error"]) == {"w8a8", "w8a16", "fp16"}
    calibrated = [name for names in choice["calibrated"].values() for name in names]
    # o, gate, up, down of each one-layer block, less the fallen o_proj
    assert len(calibrated) == 4 * 4 - 1
    assert choice["max_relative_error"]["w8a16"] < choice["max_relative_error"]["w8a8"]


@pytest.mark.slow
def test_lamp_tiny_on_npu_htp_tracks_cpu_within_2_percent_over_6_steps(tmp_path):
    for backend in ("cpu", "npu-htp"):
        run_train(
            tmp_path / backend,
            "train.max_steps=6",
            f"backend={backend}",
            "data.user=null",
            "overnight.report=false",
            *SHORT,
            recipe=LAMP_TINY,
        )
    cpu, htp = ([r["loss"] for r in _rows(tmp_path / b) if "loss" in r] for b in ("cpu", "npu-htp"))
    assert len(htp) == 6 and all(abs(h - c) / c < 0.02 for h, c in zip(htp, cpu))


@pytest.mark.slow
def test_npu_htp_resume_is_bit_identical_and_the_second_run_loads_compiled_graphs(tmp_path, monkeypatch):
    same = (
        "train.save_every=2",
        "backend=npu-htp",
        "train.lr_scheduler=constant",
        "npu_sim.calibration_steps=2",
        *SHORT,
    )
    run_train(tmp_path / "whole", "train.max_steps=4", *same)
    run_train(tmp_path / "split", "train.max_steps=2", *same)
    compiled = []
    real_compile = htp_session.HtpGraph._compile
    monkeypatch.setattr(htp_session.HtpGraph, "_compile", lambda self: compiled.append(self.name) or real_compile(self))
    run_train(tmp_path / "split", "train.max_steps=4", *same, resume=True)
    # every graph came from $LCSB_CACHE
    assert compiled == []
    assert_same_tensors(adapter_tensors(tmp_path / "whole"), adapter_tensors(tmp_path / "split"))
    whole, split = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert [r.get("loss") for r in whole if "loss" in r] == [r.get("loss") for r in split if "loss" in r]


def test_npu_htp_without_the_extra_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime_qnn" else real(name, *a)
    )
    proc = cli("validate", str(LAMP2), "backend=npu-htp")
    assert assert_one_line_error(proc).endswith("pip install -e '.[npu]'")
    proc = cli("validate", str(LAMP2), "backend=npu-htp", "npu_sim.weights=int4")
    assert proc.returncode == 2 and "npu_sim.weights" in proc.stderr
