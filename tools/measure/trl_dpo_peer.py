"""A peer on lcsb's DPO work (issue 51): TRL's DPOTrainer with a peft LoRA on the same model, data, batch, rate and
steps as `lcsb train recipes/prefs-smollm2.yaml method=full-backprop`, each side in a process of its own on this CPU,
fp32 (TRL's config defaults to bf16, which on a CPU without native bf16 is emulated: 155 s a step against 9.9 s
here), no activation checkpointing (TRL's default turns it on; lcsb's full-backprop has it off).

    python tools/measure/trl_dpo_peer.py --steps 20 --output /tmp/peer

Writes OUT/peer.json: per side the median step time over steps 3.., tokens/s at lcsb's mean tokens a step (both sides
see batches of the same pairs file, in their own orders) and peak RSS (the process's VmHWM, the reference pass
included). TRL runs twice: with its default reference (the adapter switched off, a forward every step) and with
`precompute_ref_log_probs` (once before training, as lcsb does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "prefs-smollm2.yaml"


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_trl(steps: int, precompute: bool, out: Path) -> None:
    """In its own process (the `trl` subcommand): TRL's DPOTrainer on lcsb's converted SmolLM2 checkpoint."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lcsb_cli.model.load import resolve_base_dir
    from lcsb_cli.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    torch.manual_seed(recipe.train.seed)
    checkpoint = resolve_base_dir(recipe.model.name, recipe.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    data = load_dataset("json", data_files=str(recipe.data.train), split="train")
    lora = LoraConfig(r=recipe.lora.rank, lora_alpha=recipe.lora.alpha, lora_dropout=0.0, target_modules="all-linear")
    config = DPOConfig(
        output_dir=str(out / "trl-output"),
        per_device_train_batch_size=recipe.train.batch_size,
        max_steps=steps,
        learning_rate=recipe.train.lr,
        lr_scheduler_type="cosine",
        warmup_steps=recipe.train.warmup_steps,
        beta=recipe.preference.beta,
        max_length=recipe.data.max_length,
        precompute_ref_log_probs=precompute,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=recipe.train.seed,
    )

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimes()
    trainer = DPOTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora, callbacks=[timer]
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    result = {"step_times_s": timer.times, "losses": losses, "peak_rss_mb": peak_rss_mb()}
    (out / f"trl{'-precompute' if precompute else ''}.json").write_text(json.dumps(result))


def run_lcsb(steps: int, out: Path) -> dict:
    run_dir = out / "lcsb"
    overrides = ["method=full-backprop", f"train.max_steps={steps}", "train.save_every=0", "train.autocast=none"]
    command = [sys.executable, "-m", "lcsb_cli", "train", str(RECIPE), "-o", str(run_dir), "--force", *overrides]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "step_time_s" in row]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_times_s": [row["step_time_s"] for row in rows],
        "tokens": [row["tokens"] for row in rows],
        "losses": [row["loss"] for row in rows],
        "peak_rss_mb": summary["peak_mem_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    trl = sub.add_parser("trl")
    trl.add_argument("--steps", type=int, required=True)
    trl.add_argument("--precompute", action="store_true")
    trl.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("/tmp/trl-peer"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.command == "trl":
        run_trl(args.steps, args.precompute, args.output)
        return
    lcsb = run_lcsb(args.steps, args.output)
    sides = {"lcsb full-backprop": lcsb}
    for precompute in (False, True):
        command = [sys.executable, __file__, "trl", "--steps", str(args.steps), "--output", str(args.output)]
        subprocess.run([*command, *(["--precompute"] if precompute else [])], cwd=REPO, check=True)
        name = "trl-precompute" if precompute else "trl"
        sides[f"TRL DPOTrainer{' (reference precomputed)' if precompute else ''}"] = json.loads(
            (args.output / f"{name}.json").read_text()
        )
    tokens_a_step = statistics.mean(lcsb["tokens"])
    report = {"steps": args.steps, "lcsb_mean_tokens_a_step": tokens_a_step, "sides": {}}
    for name, side in sides.items():
        median = statistics.median(side["step_times_s"][2:])
        report["sides"][name] = {
            "median_step_time_s": median,
            "tokens_per_s": tokens_a_step / median,
            "peak_rss_mb": side["peak_rss_mb"],
            "first_loss": side["losses"][0],
            "last_loss": side["losses"][-1],
        }
        print(f"{name}: {median:.3f} s a step, {tokens_a_step / median:.0f} tok/s, peak {side['peak_rss_mb']:.0f} MB")
    (args.output / "peer.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
