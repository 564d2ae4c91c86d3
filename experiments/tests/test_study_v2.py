"""experiments/study_v2.py's analysis verbs, on run directories made by hand: what docs/RESULTS.md quotes from them."""

import importlib.util
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

spec = importlib.util.spec_from_file_location("study_v2", Path(__file__).resolve().parents[1] / "study_v2.py")
study_v2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study_v2)


def write_adapter(run, deltas: dict[int, float], rank: int = 2, alpha: int = 4) -> None:
    """Layer -> the norm its q_proj update should have, once scaled by alpha / rank (here 2)."""
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha}))
    weights = {}
    for layer, norm in deltas.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        a = torch.zeros(rank, 8)
        a[0, 0] = 1.0
        b = torch.zeros(8, rank)
        b[3, 0] = norm * rank / alpha
        weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"] = a, b
    save_file(weights, run / "adapter" / "adapter_model.safetensors")


def test_block_moves_are_the_scaled_update_norms_over_each_block(tmp_path):
    # six layers in four blocks: [0, 1], [2, 3], [4], [5]
    write_adapter(tmp_path, {0: 3.0, 1: 4.0, 2: 1.0, 3: 0.0, 4: 2.0, 5: 0.5})
    assert study_v2.block_moves(tmp_path) == pytest.approx([5.0, 1.0, 2.0, 0.5])


def write_run(run, val: float, held: list[float], spare: float, step_time: float) -> None:
    """A finished study run: held-out loss every 5 steps, its validation and spare evaluations."""
    for name, loss in (("val", val), ("spare", spare)):
        (run / name).mkdir(parents=True)
        (run / name / "eval.json").write_text(json.dumps({"loss": loss}))
    rows = [{"step": 5 * (i + 1), "step_time_s": step_time} for i in range(len(held))]
    rows += [{"step": 5 * (i + 1), "eval_loss": loss} for i, loss in enumerate(held)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(json.dumps({"peak_mem_mb": 100.0, "diverged": False}))


def test_seeds_compares_each_seed_at_the_first_directorys_validated_rates(tmp_path, capsys):
    first, second = tmp_path / "seed0" / "qa-fp32", tmp_path / "seed1" / "qa-fp32"
    write_run(first / "full-backprop" / "lr-1e-3", 0.5, [2.0, 1.0], 1.2, 2.0)
    write_run(first / "full-backprop" / "lr-3e-3", 0.7, [2.0, 0.1], 0.1, 2.0)
    write_run(first / "lcsb_4_suffix" / "lr-3e-3", 0.6, [1.0, 1.2], 1.5, 1.0)
    write_run(second / "full-backprop" / "lr-1e-3", 0.5, [2.0, 1.0], 1.2, 2.0)
    write_run(second / "lcsb_4_suffix" / "lr-3e-3", 0.6, [2.0, 1.4], 1.2, 1.0)
    # a better-validated rate in the second directory must not replace the first's choice
    write_run(second / "lcsb_4_suffix" / "lr-1e-2", 0.1, [2.0, 0.2], 0.2, 1.0)
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "methods": [
                    {"name": "full-backprop", "median_step_time_s": 2.0},
                    {"name": "lcsb:4:suffix", "median_step_time_s": 1.0},
                ]
            }
        )
    )
    args = Namespace(
        outs=[str(tmp_path / "seed0"), str(tmp_path / "seed1")],
        task="qa",
        base="fp32",
        method="lcsb:4:suffix",
        times=str(bench),
        ckpt_speedup=2.0,
    )
    study_v2.seeds(args)
    lines = capsys.readouterr().out.splitlines()
    # finals: full 1.0 and 1.0, suffix 1.2 and 1.4
    assert "final: 1.300 against 1.000 (+30.0%) over 2 seeds; per-seed gaps +30.0% +- 10.0% (standard error)" in lines
    assert any(line.startswith("spare: 1.350 against 1.200 (+12.5%)") for line in lines)
    # suffix's 10 steps take 10 s; full backprop's curve at 10 s is its step 5: 2.0
    # equal memory: seed 0's suffix is within 1.02 of full backprop's final at step 5, full backprop at step 10, and a
    # suffix step takes half a checkpointed one's time; seed 1's never gets there
    assert lines[2].endswith("equal memory 0.25 |") and lines[3].endswith("equal memory never |")
    assert any(line.startswith("equal time: 1.300 against 2.000 (-35.0%)") for line in lines)
