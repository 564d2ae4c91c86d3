"""The training step: per-token loss across accumulation, non-finite guard, checkpointing equivalence."""

import copy
import math

import pytest
import torch
from helpers import LAMP2, adapter_tensors, assert_same_tensors, run_train

from lcsb_cli.backends import CpuBackend
from lcsb_cli.data import build_train_batches
from lcsb_cli.methods import FullBackprop, make_optimizer
from lcsb_cli.model.load import load_model, lora_parameters
from lcsb_cli.model.losses import causal_lm_loss
from lcsb_cli.recipe import load_recipe
from lcsb_cli.run.divergence import Divergence
from lcsb_cli.run.trainer import Trainer
from lcsb_cli.rundir import read_metrics


def make_trainer(*overrides, loss_fn=causal_lm_loss, optimizer_class=torch.optim.AdamW):
    recipe = load_recipe(LAMP2, ["method=full-backprop", *overrides])
    loaded = load_model(recipe, torch.device("cpu"))
    params = lora_parameters(loaded.model)
    optimizer = optimizer_class(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    method = FullBackprop(loaded.model, recipe.activation_checkpointing)
    batches = build_train_batches(recipe, loaded.tokenizer)
    loaded.model.train()
    return Trainer(
        model=loaded.model,
        params=params,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        method=method,
        batches=batches,
        backend=CpuBackend(),
        grad_accum=recipe.train.grad_accum,
        max_grad_norm=recipe.train.max_grad_norm,
        autocast="none",
        divergence=Divergence(recipe.divergence, params, optimizer, None),
        loss_fn=loss_fn,
    ), loaded


def test_loss_is_normalised_per_target_token_across_accumulation():
    # SGD: the update is lr x gradient, so the weights compare the gradients (Adam's step would hide their scale)
    whole, _ = make_trainer("train.batch_size=4", "train.grad_accum=1", optimizer_class=torch.optim.SGD)
    split, _ = make_trainer("train.batch_size=2", "train.grad_accum=2", optimizer_class=torch.optim.SGD)
    a, b = whole.step(0), split.step(0)
    assert a["tokens"] == b["tokens"]
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
    for p, q in zip(whole.params, split.params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("action,event", [("skip", "diverged"), ("rollback", "rollback")])
def test_a_nonfinite_loss_never_reaches_the_weights(action, event):
    poison = {"on": False}

    def poisoned(model, batch):
        loss = causal_lm_loss(model, batch)
        return loss * float("nan") if poison["on"] else loss

    trainer, _loaded = make_trainer(f"divergence.action={action}", loss_fn=poisoned)
    initial = [p.detach().clone() for p in trainer.params]
    # AdamW has state after a clean step, so a NaN step would visibly move the weights
    trainer.step(0)
    after_first = [p.detach().clone() for p in trainer.params]
    lr = trainer.optimizer.param_groups[0]["lr"]
    poison["on"] = True
    row = trainer.step(1)
    assert row["event"] == event and "nan" in row["reason"]
    # skip drops the update; rollback returns to the last weights a forward pass found sound (before step 0's
    # update, which the NaN forward of step 1 condemns)
    expected = after_first if action == "skip" else initial
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, expected))
    assert all(p.grad is None for p in trainer.params)
    expected_lr = lr * 0.5 if action == "rollback" else lr
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)


def adamw8bit(params, lr):
    return make_optimizer("adamw8bit", params, lr, weight_decay=0.0)


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, adamw8bit])
def test_rollback_restores_weights_and_moments_of_the_last_good_step(optimizer_class):
    trainer, _ = make_trainer("divergence.action=rollback", optimizer_class=optimizer_class)
    trainer.step(0)
    good = [p.detach().clone() for p in trainer.params]
    moments = {id(p): copy.deepcopy(trainer.optimizer.state[p]) for p in trainer.params}
    # a poisoned update: moments and step counts advance, weights turn inf
    real_step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (real_step(), [p.data.fill_(float("inf")) for p in trainer.params])
    row = trainer.step(1)
    assert row["event"] == "rollback" and "non-finite" in row["reason"]
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, good))
    for p in trainer.params:
        for k, v in trainer.optimizer.state[p].items():
            assert torch.equal(v, moments[id(p)][k]) if torch.is_tensor(v) else v == moments[id(p)][k]


@pytest.mark.parametrize("autocast", ["none", "bf16"])
@pytest.mark.parametrize("method", ["lcsb", "lcsb.upper_path=suffix", "full-backprop"])
def test_activation_checkpointing_changes_no_number(tmp_path, method, autocast):
    """Under bf16 also with the casts that LoRA layers share (model/precision.py), made again in the recompute."""
    chosen = [f"method={method}"] if "=" not in method else ["method=lcsb", method]
    chosen.append(f"train.autocast={autocast}")
    run_train(tmp_path / "plain", *chosen, "train.max_steps=3", "lcsb.blocks=2")
    run_train(tmp_path / "ckpt", *chosen, "train.max_steps=3", "lcsb.blocks=2", "activation_checkpointing=true")
    losses = [[r["loss"] for r in read_metrics(tmp_path / d / "metrics.jsonl")] for d in ("plain", "ckpt")]
    assert losses[0] == losses[1]
    assert_same_tensors(adapter_tensors(tmp_path / "plain"), adapter_tensors(tmp_path / "ckpt"))


def test_idle_update_none_leaves_idle_blocks_alone_and_momentum_moves_them(tmp_path):
    for idle in ("none", "momentum"):
        run_train(
            tmp_path / idle,
            f"lcsb.experimental.idle_update={idle}",
            "train.max_steps=2",
            "lcsb.blocks=2",
            "train.warmup_steps=0",
        )
    # Step 1 trains block 0 (layers 0-1), step 2 block 1 (layers 2-3): block 0 is idle, with moments, on step 2.
    none, momentum = adapter_tensors(tmp_path / "none"), adapter_tensors(tmp_path / "momentum")
    block0 = [k for k in none if ".layers.0." in k or ".layers.1." in k]
    block1 = [k for k in none if ".layers.2." in k or ".layers.3." in k]
    assert all(torch.equal(none[k], momentum[k]) for k in block1)
    assert all(not torch.equal(none[k], momentum[k]) for k in block0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backend_trains_with_bf16_autocast(tmp_path):
    summary = run_train(tmp_path / "cuda", "backend=cuda", "train.autocast=bf16", "train.max_steps=4")
    assert math.isfinite(summary["final_loss"]) and summary["peak_mem_mb"] > 0


def test_target_position_loss_equals_the_full_logits_loss_and_gradients():
    import torch.nn.functional as F

    trainer, loaded = make_trainer()
    batch = trainer.batches.batch(0)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    causal_lm_loss(loaded.model, batch).backward()
    fast = {n: p.grad.clone() for n, p in loaded.model.named_parameters() if p.grad is not None}
    loaded.model.zero_grad(set_to_none=True)
    logits = loaded.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    F.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
    ).backward()
    for name, p in loaded.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(fast[name], p.grad, rtol=1e-4, atol=1e-6)
    assert len(fast) > 0


@pytest.mark.slow
def test_lr_1000_stop_exits_3_naming_the_step_and_rollback_ends_finite(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from helpers import REPO
    from safetensors.torch import load_file

    def train(name, action):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "lcsb_cli",
                "train",
                str(LAMP2),
                "--output",
                str(tmp_path / name),
                "train.lr=1000",
                "train.max_steps=25",
                f"divergence.action={action}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )

    stopped = train("stop", "stop")
    assert stopped.returncode == 3, stopped.stderr
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith("error: training diverged at step ") and "Traceback" not in stopped.stderr
    step = int(line.split("at step ")[1].split(":")[0])
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary["diverged"] is True and (tmp_path / "stop" / "checkpoints" / f"step-{step}").is_dir()

    rolled = train("rollback", "rollback")
    assert rolled.returncode == 0, rolled.stderr
    rows = [json.loads(x) for x in (tmp_path / "rollback" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "rollback" for r in rows)
    assert math.isfinite(rows[-1]["loss"])
    summary = json.loads((tmp_path / "rollback" / "summary.json").read_text())
    assert summary["events"]["rollback"] == sum(r.get("event") == "rollback" for r in rows)
    adapter = load_file(tmp_path / "rollback" / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_running_out_of_memory_is_bad_input_with_the_figure_and_hints(tmp_path, monkeypatch):
    from lcsb_cli.errors import BadInput
    from lcsb_cli.run import engine

    def no_memory(self, step):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(engine.Trainer, "step", no_memory)
    with pytest.raises(BadInput) as caught:
        run_train(tmp_path / "run", "train.max_steps=2")
    message = str(caught.value)
    assert "out of memory at step 1" in message and "MB" in message
    assert all(hint in message for hint in ("train.batch_size", "activation_checkpointing", "lcsb.blocks", "nf4"))


def test_other_runtime_errors_are_not_disguised_as_memory_errors(tmp_path, monkeypatch):
    from lcsb_cli.run import engine

    monkeypatch.setattr(
        engine.Trainer, "step", lambda self, step: (_ for _ in ()).throw(RuntimeError("shape mismatch"))
    )
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_train(tmp_path / "run", "train.max_steps=2")


def test_without_a_terminal_the_run_prints_plain_whole_lines(tmp_path):
    from rich.console import Console

    from lcsb_cli.display import SPARKS, RichDisplay, number
    from lcsb_cli.run.entry import train

    run_dir = tmp_path / "a-run-directory-with-a-long-name-so-the-header-would-wrap-at-eighty"
    with open(tmp_path / "log.txt", "w") as log:
        console = Console(file=log, width=80, force_terminal=False)
        summary = train(load_recipe(LAMP2, ["train.max_steps=4", "train.eval_every=4"]), run_dir, RichDisplay(console))
    lines = (tmp_path / "log.txt").read_text().splitlines()
    # the header is one line
    assert any(line.endswith(f"-> {run_dir}") for line in lines)
    steps = [line for line in lines if line.startswith("step ") and " loss " in line]
    assert len(steps) == 4 and all(" lr " in line and " tok/s " in line for line in steps)
    assert not any(char in "".join(lines) for char in SPARKS)
    assert [line.split(":")[0] for line in lines if "eval_loss" in line] == ["step 4"]
    assert lines[-1] == f"adapter saved to {run_dir / 'adapter'}; next: lcsb eval {run_dir}"
    assert summary["load_time_s"] > 0 and summary["peak_mem_mb"] == summary["memory"]["peak_rss_mb"]
    assert (number(18040.2), number(0.012345), number(449.31)) == ("18,040", "0.01235", "449.3")


def test_the_end_of_a_run_says_what_it_bought():
    from lcsb_cli.display import what_it_bought

    before = {"n": 90, "accuracy": 0.5111, "macro_f1": 0.4812, "majority_accuracy": 0.1444, "loss": 2.0}
    after = {**before, "accuracy": 0.6889, "macro_f1": 0.6533}
    assert what_it_bought(before, after) == (
        "held-out accuracy 0.511 -> 0.689 (majority 0.144), macro-F1 0.481 -> 0.653"
    )
    assert (
        what_it_bought({"loss": 3.0, "perplexity": 20.1}, {"loss": 2.0, "perplexity": 7.4})
        == "held-out perplexity 20.100 -> 7.400"
    )
