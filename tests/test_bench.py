"""`lcsb bench`: every method in one bench.json with the contract's fields, and the plot renders."""

import json
import os
import subprocess
import sys

import pytest
from helpers import LAMP2, REPO, cli

FIELDS = {"name", "median_step_time_s", "tokens_per_s", "peak_mem_mb", "final_loss", "eval", "diverged", "speedup"}


@pytest.mark.slow
def test_bench_runs_methods_interleaved_and_writes_its_reports(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "lcsb_cli",
        "bench",
        str(LAMP2),
        "--compare",
        "full-backprop",
        "--compare",
        "mezo",
        "--compare",
        "hf-trainer",
        "--compare",
        "lcsb:2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--eval",
        "--output",
        str(out),
        "lcsb.blocks=4",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["baseline"] == "full-backprop"
    assert [m["name"] for m in result["methods"]] == [
        "lcsb:4:identity",
        "full-backprop",
        "mezo",
        "hf-trainer",
        "lcsb:2",
    ]
    for method in result["methods"]:
        assert set(method) >= FIELDS
        assert method["eval"]["n"] == 90 and 0 <= method["eval"]["accuracy"] <= 1
    base = next(m for m in result["methods"] if m["name"] == "full-backprop")
    assert base["speedup"] == 1.0
    estimated = {m["name"] for m in result["methods"] if "ideal_speedup" in m}
    assert estimated == {"lcsb:4:identity", "lcsb:2"}
    assert all(
        m["median_forward_s"] > 0 and m["median_backward_s"] > 0
        for m in result["methods"]
        if m["name"] in ("lcsb:4:identity", "lcsb:2", "full-backprop")
    )
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "| lcsb:4:identity |" in (out / "bench.md").read_text() and "ideal speedup" in (out / "bench.md").read_text()
    memory = {m["name"]: m["memory"] for m in result["methods"]}
    # HF's own loop: the engine's probes see none of it
    assert memory["hf-trainer"] is None
    assert 0 < memory["lcsb:4:identity"]["activations_mb"] < memory["full-backprop"]["activations_mb"] / 2
    assert "Peak RSS breakdown" in (out / "bench.md").read_text()
    assert set(result["matmul_limit_gflops"]) == {"float32", "bfloat16"} and result["matmul_probe"]["threads"] >= 1
    assert all(
        m["model_gflop_per_step"] > 0 and m["achieved_gflops"] > 0 and m["roofline_fraction"] > 0
        for m in result["methods"]
    )
    # the same batches for every method
    gflop = {m["name"]: m["model_gflop_per_step"] for m in result["methods"]}
    # HF: logits everywhere
    assert gflop["lcsb:4:identity"] < gflop["lcsb:2"] < gflop["full-backprop"] < gflop["hf-trainer"]
    assert "GFLOP/s (of limit)" in (out / "bench.md").read_text()


@pytest.mark.slow
def test_bench_evaluates_a_completion_recipe_by_loss_and_rouge(tmp_path):
    out, qa = tmp_path / "bench", REPO / "recipes" / "data" / "qa"
    cmd = [
        sys.executable,
        "-m",
        "lcsb_cli",
        "bench",
        str(LAMP2),
        "--compare",
        "full-backprop",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--eval",
        "--output",
        str(out),
        "data.format=completion",
        f"data.train={qa / 'train.jsonl'}",
        f"data.eval={qa / 'eval.jsonl'}",
        "data.train_labels=null",
        "data.eval_labels=null",
        "data.max_length=64",
        "eval.max_new_tokens=2",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for method in json.loads((out / "bench.json").read_text())["methods"]:
        assert method["eval"]["n"] == 60
        assert {"loss", "perplexity", "exact_match", "rouge1", "rougeL"} <= set(method["eval"])
    assert "eval rougeL" in (out / "bench.md").read_text()


@pytest.mark.slow
def test_bench_refuses_an_unknown_method_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lcsb_cli", "bench", str(LAMP2), "--compare", "sgd", "--output", str(tmp_path / "b")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown method 'sgd'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()


def _rows(step_s, forward_s=None, backward_s=None, sim_s=None, tokens=100, event=None):
    """Hand-made step rows: per-step times as given, peak rising by 10 MB a step, loss 3, 2, 1, ..."""
    rows = []
    for i, step in enumerate(step_s):
        row = {"step_time_s": step, "tokens": tokens, "peak_mem_mb": 100.0 + 10 * i, "loss": len(step_s) - i}
        if forward_s:
            row.update(forward_s=forward_s[i], backward_s=backward_s[i])
        if sim_s:
            row.update(
                sim_step_time_s=sim_s[i],
                sim_energy_j=sim_s[i] * 4,
                sim_temp_c=30.0 + i,
                npu_util=0.5,
                sim_npu_s=sim_s[i] / 2,
                sim_cpu_s=sim_s[i] * 0.75,
                sim_gpu_trainer_s=sim_s[i] * 2,
                sim_cpu_trainer_s=sim_s[i] * 3,
            )
        rows.append(row)
    if event:
        rows[0]["event"] = event
    return rows


def test_summarize_bench_gives_hand_computed_figures():
    from lcsb_cli.bench.compare import summarize_bench

    timed = {
        "lcsb:4": _rows([0.5, 0.7, 0.6], [0.1, 0.12, 0.08], [0.3, 0.2, 0.25]),
        "full-backprop": _rows([1.3, 1.1, 1.2], [0.4, 0.5, 0.3], [0.8, 0.9, 0.7]),
        # forward-only: no forward/backward split
        "mezo": _rows([0.4, 0.4, 0.4], tokens=50),
    }
    warmup = {name: _rows([9.0], [9.0], [9.0], event="rollback" if name == "mezo" else None) for name in timed}
    result = summarize_bench(list(timed), timed, {n: warmup[n] + timed[n] for n in timed}, {})
    lcsb, full, mezo = result["methods"]
    assert result["baseline"] == "full-backprop"
    assert (lcsb["median_forward_s"], lcsb["median_backward_s"]) == (0.1, 0.25)
    assert (full["median_forward_s"], full["median_backward_s"]) == (0.4, 0.8)
    assert lcsb["median_step_time_s"] == 0.6 and lcsb["speedup"] == pytest.approx(2.0)
    # 4.0
    assert lcsb["ideal_speedup"] == pytest.approx((0.4 + 0.8) / (0.1 + 0.8 / 4))
    assert lcsb["efficiency"] == pytest.approx(0.5)
    assert lcsb["tokens_per_s"] == pytest.approx(300 / 1.8) and mezo["tokens_per_s"] == pytest.approx(150 / 1.2)
    assert lcsb["peak_mem_mb"] == 120.0 and lcsb["final_loss"] == 1
    assert full["speedup"] == 1.0 and mezo["speedup"] == pytest.approx(3.0)
    assert "ideal_speedup" not in full and "median_forward_s" not in mezo and "ideal_speedup" not in mezo
    assert [m["diverged"] for m in result["methods"]] == [False, False, True]


def test_ideal_speedup_needs_full_backprop():
    from lcsb_cli.bench.compare import summarize_bench

    timed = {"lcsb:4": _rows([0.5], [0.1], [0.2]), "lcsb:2": _rows([1.0], [0.2], [0.4])}
    result = summarize_bench(list(timed), timed, timed, {})
    assert result["baseline"] == "lcsb:4" and result["methods"][1]["speedup"] == 0.5
    assert not any("ideal_speedup" in m for m in result["methods"])


def _markdown_tables(text: str) -> list[list[list[str]]]:
    """The tables of a markdown text, each as its rows of cells (header first, separator dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if "---" not in line:
                current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            tables, current = tables + [current], []
    return tables


def test_markdown_and_rich_show_the_same_cells():
    from lcsb_cli.bench.compare import summarize_bench
    from lcsb_cli.bench.seeds import combine_seeds
    from lcsb_cli.bench.table import bench_markdown, bench_rich
    from lcsb_cli.recipe import load_recipe

    timed = {
        "lcsb:4": _rows([0.5, 0.6], [0.1, 0.1], [0.2, 0.2], sim_s=[0.02, 0.03]),
        "full-backprop": _rows([1.0, 1.2], [0.3, 0.3], [0.6, 0.6], sim_s=[0.05, 0.06]),
    }
    parts = {
        "peak_rss_mb": 900,
        "runtime_mb": 300,
        "weights_mb": 400,
        "lora_optimizer_mb": 10,
        "activations_mb": 90,
        "logits_mb": 20,
        "other_mb": 80,
    }
    result = combine_seeds(
        [
            summarize_bench(
                list(timed),
                timed,
                timed,
                {"lcsb:4": {"accuracy": 0.25}, "full-backprop": None},
                {"lcsb:4": parts, "full-backprop": parts},
            )
        ],
        [0],
    )
    recipe = load_recipe(LAMP2, ["backend=npu-sim"])
    rich = [
        [[c.header for c in t.columns], *zip(*(list(c.cells) for c in t.columns))]
        for t in bench_rich(result, recipe).renderables
    ]
    markdown = _markdown_tables(bench_markdown(result, recipe, 2, 0))
    # per method, forward and backward, simulated phone, memory breakdown
    assert len(markdown) == 4
    assert markdown == [[list(row) for row in table] for table in rich]
    assert markdown[0][1] == ["lcsb:4", "2", "0.550", "182", "110", "1.0000", "2.00x", "", "0.250"]
    assert markdown[1][1:] == [
        ["lcsb:4", "0.100", "0.200", "3.60x", "0.56"],
        ["full-backprop", "0.300", "0.600", "", ""],
    ]
    assert markdown[2][1] == ["lcsb:4", "25.00", "12.50", "18.75", "50.00", "75.00", "100.0", "0.50", "2.20x"]


def test_bench_on_npu_sim_reports_the_simulated_phone_per_method():
    from lcsb_cli.bench.compare import summarize_bench
    from lcsb_cli.bench.seeds import combine_seeds
    from lcsb_cli.bench.table import bench_markdown
    from lcsb_cli.recipe import load_recipe

    timed = {
        "lcsb:4": _rows([1.0] * 3, sim_s=[0.02, 0.03, 0.025]),
        "full-backprop": _rows([1.0] * 3, sim_s=[0.05, 0.06, 0.05]),
    }
    result = combine_seeds([summarize_bench(["lcsb:4", "full-backprop"], timed, timed, {})], [0])
    lcsb, full = result["methods"]
    assert full["sim_speedup"] == 1.0 and lcsb["sim_speedup"] == 0.05 / 0.025
    assert lcsb["sim_median_energy_j"] == 0.1 and lcsb["sim_energy_j"] == pytest.approx(0.3)
    assert lcsb["sim_max_temp_c"] == 32.0 and lcsb["npu_util"] == 0.5
    text = bench_markdown(result, load_recipe(LAMP2, ["backend=npu-sim"]), 3, 0)
    assert "Simulated on-device (npu-sim, snapdragon-8gen3, int8 weights)" in text and "| lcsb:4 | 25.00 |" in text


def test_combine_seeds_gives_means_sample_stds_and_each_seeds_values():
    from lcsb_cli.bench.compare import summarize_bench
    from lcsb_cli.bench.seeds import combine_seeds

    def one_seed(last_loss: float, accuracy: float) -> dict:
        timed = {"lcsb:4": _rows([0.5, 0.5]), "full-backprop": _rows([1.0, 1.0])}
        timed["lcsb:4"][-1]["loss"] = last_loss
        return summarize_bench(
            list(timed),
            timed,
            timed,
            {"lcsb:4": {"accuracy": accuracy, "n": 90}, "full-backprop": {"accuracy": 0.5, "n": 90}},
        )

    result = combine_seeds([one_seed(1.0, 0.2), one_seed(3.0, 0.4)], [5, 6])
    lcsb = result["methods"][0]
    assert result["seeds"] == [5, 6]
    assert lcsb["final_loss"] == 2.0 and lcsb["std"]["final_loss"] == pytest.approx(2**0.5)
    assert lcsb["eval"] == {"accuracy": pytest.approx(0.3), "n": 90}
    assert lcsb["std"]["eval"]["accuracy"] == pytest.approx(0.02**0.5)
    assert [(s["seed"], s["final_loss"], s["eval"]["accuracy"], s["steps"]) for s in lcsb["seeds"]] == [
        (5, 1.0, 0.2, 2),
        (6, 3.0, 0.4, 2),
    ]
    same = combine_seeds([one_seed(1.0, 0.2), one_seed(1.0, 0.2)], [0, 0])["methods"][0]
    assert same["std"]["final_loss"] == 0 and same["std"]["eval"]["accuracy"] == 0


class FakeWorker:
    """A bench worker whose every step takes `step_s` seconds; records the LR horizon it is given."""

    def __init__(self, name: str, step_s: float):
        self.name, self.step_s, self.rows, self.horizon = name, step_s, [], None

    def ask(self, command: str, arg):
        if command == "horizon":
            self.horizon = arg
            return None
        return {"step": arg + 1, "loss": 1.0, "step_time_s": self.step_s}


def test_equal_time_gives_each_method_full_backprops_time_within_one_step():
    from lcsb_cli.bench.session import _equal_time

    workers = {
        "lcsb:4": FakeWorker("lcsb:4", 0.35),
        "full-backprop": FakeWorker("full-backprop", 1.0),
        "full-backprop+ckpt": FakeWorker("full-backprop+ckpt", 1.6),
    }
    warmup = 1
    for worker in workers.values():
        # a slow untimed warm-up step is not counted
        worker.rows.append({"loss": 9.0, "step_time_s": 50.0})
    _equal_time(workers, steps=10, warmup=warmup, display=None)

    spent = {name: sum(r["step_time_s"] for r in w.rows[warmup:]) for name, w in workers.items()}
    taken = {name: len(w.rows) - warmup for name, w in workers.items()}
    assert taken["full-backprop"] == 10 and spent["full-backprop"] == pytest.approx(10.0)
    for name in ("lcsb:4", "full-backprop+ckpt"):
        assert 10.0 <= spent[name] < 10.0 + workers[name].step_s
    assert taken == {"lcsb:4": 29, "full-backprop": 10, "full-backprop+ckpt": 7}
    assert workers["lcsb:4"].horizon == warmup + round(10 / 0.35) and workers["full-backprop"].horizon is None


@pytest.mark.slow
def test_bench_over_seeds_at_equal_time_and_its_eval_matches_lcsb_eval(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lcsb_cli",
            "bench",
            str(LAMP2),
            "--compare",
            "full-backprop",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--seeds",
            "2",
            "--budget",
            "equal-time",
            "--eval",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["budget"] == "equal-time" and result["seeds"] == [0, 1]
    assert [m["name"] for m in result["methods"]] == ["lcsb:4:identity", "full-backprop"]
    # no TTY: plain lines, every step of every method and seed, then its eval
    progress = proc.stderr.splitlines()
    assert "seed 1 full-backprop step 3: loss " in proc.stderr and "seed 0 lcsb:4:identity: evaluating" in progress
    full = result["methods"][1]
    for method in result["methods"]:
        per_seed = method["seeds"]
        assert [s["seed"] for s in per_seed] == [0, 1]
        assert method["final_loss"] == pytest.approx(sum(s["final_loss"] for s in per_seed) / 2)
        assert method["eval"]["accuracy"] == pytest.approx(sum(s["eval"]["accuracy"] for s in per_seed) / 2)
        for own, target in zip(per_seed, full["seeds"]):
            assert own["train_time_s"] >= target["train_time_s"]
    assert "Per seed" in (out / "bench.md").read_text()

    adapter = out / "adapters" / "seed-1" / "lcsb-4-identity"
    evaluated = cli("eval", str(LAMP2), "--adapter", str(adapter), "--output", str(tmp_path / "eval"))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    direct = json.loads((tmp_path / "eval" / "eval.json").read_text())
    from_bench = result["methods"][0]["seeds"][1]["eval"]
    assert from_bench["n"] == direct["n"] > 0
    for key in ("accuracy", "macro_f1", "loss"):
        assert from_bench[key] == pytest.approx(direct[key], abs=1e-9)


def test_lcsb_variants_name_their_upper_path_and_refuse_bad_names():
    from lcsb_cli.bench.compare import method_names, method_recipe
    from lcsb_cli.errors import BadInput
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(LAMP2)
    names = method_names(recipe, ["lcsb:2", "lcsb:4:suffix", "lcsb:4:exact"])
    # the budget's
    assert method_names(recipe, ["lcsb:2"], "equal-time") == ["lcsb:4:identity", "lcsb:2", "full-backprop"]
    assert names == ["lcsb:4:identity", "lcsb:2", "lcsb:4:suffix", "lcsb:4:exact"]
    paths = [
        (r.lcsb.blocks, r.lcsb.upper_path, r.train.max_steps) for r in (method_recipe(recipe, n, 7) for n in names)
    ]
    assert paths == [(4, "identity", 7), (2, "identity", 7), (4, "suffix", 7), (4, "exact", 7)]
    # an experimental dial off its default names itself in the recipe's own label, which runs it again
    dialled = load_recipe(LAMP2, ["lcsb.experimental.exact_above=3"])
    [own] = method_names(dialled, [])
    assert own == "lcsb:4:identity@lcsb.experimental.exact_above=3"
    assert method_recipe(dialled, own, 7).lcsb.experimental.exact_above == 3
    # lcsb:K:exactW left the grammar with lcsb.exact_above
    for bad in ("lcsb:4:exactly", "lcsb:0", "lcsb:4:exact-1", "lcsb:4:exact8"):
        with pytest.raises(BadInput, match="unknown method"):
            method_names(recipe, [bad])
    with pytest.raises(BadInput, match="--budget"):
        method_names(recipe, [], "equal-energy")


def test_hf_trainer_is_known_by_its_label_with_or_without_overrides():
    from lcsb_cli.bench.session import hf_trainer_bf16, is_hf_trainer

    assert is_hf_trainer("hf-trainer") and is_hf_trainer("hf-trainer:bf16@lora.rank=8")
    assert not is_hf_trainer("full-backprop") and not is_hf_trainer("hf-trainer:fp16")
    assert hf_trainer_bf16("hf-trainer:bf16@lora.rank=8") and not hf_trainer_bf16("hf-trainer@lora.rank=8")


def test_the_recipes_own_method_keeps_its_checkpointing():
    from lcsb_cli.bench.compare import method_names, method_recipe
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(LAMP2, ["method=full-backprop", "activation_checkpointing=true"])
    names = method_names(recipe, ["full-backprop"])
    assert names == ["full-backprop+ckpt", "full-backprop"]
    assert [method_recipe(recipe, name, 7).activation_checkpointing for name in names] == [True, False]


def test_a_compared_method_can_carry_recipe_overrides():
    from lcsb_cli.bench.compare import method_names, method_recipe
    from lcsb_cli.errors import BadInput
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(LAMP2)
    name = "lcsb:2@lora.rank=64,lora.backward=mesp"
    assert method_names(recipe, [name]) == ["lcsb:4:identity", name]
    variant = method_recipe(recipe, name, 7)
    assert (variant.lcsb.blocks, variant.lora.rank, variant.lora.backward, variant.train.max_steps) == (
        2,
        64,
        "mesp",
        7,
    )
    assert method_recipe(recipe, "full-backprop@lora.rank=8", 7).lora.rank == 8
    with pytest.raises(BadInput, match="lora.backward: 'fast' is not one of"):
        method_names(recipe, ["lcsb:2@lora.backward=fast"])
    with pytest.raises(BadInput, match="lora.rnk"):
        method_names(recipe, ["lcsb:2@lora.rnk=8"])


def _shape(layers: int = 2, targets=("q_proj", "v_proj")):
    from types import SimpleNamespace

    from lcsb_cli.bench.roofline import ModelShape
    from lcsb_cli.recipe import load_recipe

    config = SimpleNamespace(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        num_hidden_layers=layers,
        vocab_size=32,
    )
    return ModelShape.of(config, load_recipe(LAMP2, ["lora.rank=2", f"lora.targets=[{','.join(targets)}]"]))


def test_step_flops_match_a_hand_count():
    """hidden 8, intermediate 16, 2 heads / 1 KV head of 4, 2 layers, vocab 32, LoRA r=2 on q and v; one row of 3
    tokens, 2 of them targets. Per layer: projections 2*3*(64+32+32+64+128+128+128) = 3456; LoRA B sides
    2*3*2*(8+4) = 144, A sides 2*3*2*(8+8) = 192; attention 4*1*2*3^2*4 = 288. Head 2*2*8*32 = 1024.
    Forward 2*(3456+144+192+288) + 1024 = 9184. Full backprop: per layer 3456+144+192+2*288 = 4368 plus LoRA weight
    gradients 336; the lowest layer drops its q/k/v input gradients 2*3*(64+32+32) = 768 and q/v A-side 192:
    (4368-960+336) + (4368+336) + head 1024 = 9472."""
    from lcsb_cli.bench.compare import method_recipe
    from lcsb_cli.bench.roofline import StepFlops, plan_for
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(LAMP2)
    shape = _shape()

    def count(name: str) -> float:
        return StepFlops(shape, plan_for(method_recipe(recipe, name, 1), 2)).micro_batch(1, 3, 2)

    assert count("full-backprop") == count("full-backprop+ckpt") == 9184 + 9472
    assert count("mezo") == 2 * 9184
    # each block: one layer, the lowest, trained
    assert count("lcsb:2") == 9184 + (4368 - 960 + 336) + 1024
    # block 0 sees layer 1 too
    assert count("lcsb:2:exact") == 9184 + ((4368 - 960 + 336) * 2 + 4368 + 1024 * 2) / 2


def test_lcsb_and_mezo_count_less_backward_than_full_backprop():
    from lcsb_cli.bench.compare import method_recipe
    from lcsb_cli.bench.roofline import Plan, StepFlops, plan_for
    from lcsb_cli.recipe import load_recipe

    recipe, shape = load_recipe(LAMP2), _shape(layers=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    forward = StepFlops(shape, Plan(1, *([(0.0,) * 4] * 3))).micro_batch(4, 100, 20)
    backward = {
        name: StepFlops(shape, plan_for(method_recipe(recipe, name, 1), 4)).micro_batch(4, 100, 20) - forward
        for name in ("full-backprop", "lcsb:4", "lcsb:4:exact", "freeze", "lisa", "mezo")
    }
    # two forwards, no backward
    assert backward["mezo"] == forward
    assert 0 < backward["lcsb:4"] < backward["full-backprop"] / 3
    assert backward["lcsb:4"] < backward["lcsb:4:exact"] < backward["full-backprop"]
    assert backward["lisa"] < backward["full-backprop"]
    # 2 of 4 layers drawn: lowest is 0 with 3/6, 1 with 2/6
    lisa = plan_for(method_recipe(recipe, "lisa", 1), 4)
    assert lisa.lowest == pytest.approx((0.5, 1 / 3, 1 / 6, 0)) and lisa.through[-1] == 1 and lisa.trained[0] == 0.5


def test_matmul_probe_measures_both_dtypes():
    from lcsb_cli.bench.roofline import probe_matmul

    probe = probe_matmul(_shape(), tokens=64, seconds=0.01)
    assert set(probe["matmul_limit_gflops"]) == {"float32", "bfloat16"}
    assert all(rate > 0 for rate in probe["matmul_limit_gflops"].values())
    assert [64, 8, 16] in probe["matmul_probe"]["shapes"] and len(probe["matmul_probe"]["shapes"]) == 4
    # conftest pins LCSB_CPU_BF16=emulated
    assert probe["matmul_probe"]["host"] == "emulated: no native bf16"


def test_roofline_fields_and_their_column():
    from lcsb_cli.bench.compare import summarize_bench
    from lcsb_cli.bench.seeds import combine_seeds
    from lcsb_cli.bench.table import bench_markdown
    from lcsb_cli.recipe import load_recipe

    timed = {"lcsb:4": _rows([0.5, 0.7, 0.6]), "full-backprop": _rows([1.0, 1.2, 1.1])}
    for name, gflop in (("lcsb:4", [3, 3, 6]), ("full-backprop", [8, 8, 8])):
        for row, value in zip(timed[name], gflop):
            row["model_flops"] = value * 1e9
    result = combine_seeds(
        [
            summarize_bench(
                list(timed),
                timed,
                timed,
                {},
                None,
                {"lcsb:4": "bfloat16", "full-backprop": "float32"},
                {"float32": 20.0, "bfloat16": 10.0},
            )
        ],
        [0],
    )
    result.update(
        matmul_limit_gflops={"float32": 20.0, "bfloat16": 10.0},
        matmul_probe={"shapes": [[64, 8, 16]], "threads": 2, "host": "native bf16: amx_bf16"},
    )
    lcsb, full = result["methods"]
    assert lcsb["model_gflop_per_step"] == 4 and lcsb["achieved_gflops"] == pytest.approx(4 / 0.6)
    assert lcsb["roofline_fraction"] == pytest.approx(4 / 0.6 / 10) and full["roofline_fraction"] == pytest.approx(
        8 / 1.1 / 20
    )
    text = bench_markdown(result, load_recipe(LAMP2), 3, 0)
    assert "| lcsb:4 | 3 | 0.600 | 167 | 6.7 (67% of bf16) |" in text
    assert "fp32 20.0, bf16 10.0 (native bf16: amx_bf16)" in text
