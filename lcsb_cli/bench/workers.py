"""Bench workers: one process per method, stepping only when the coordinator says so.

Each method lives in its own spawned process so its peak RSS is its own (a process's peak only rises), and the
coordinator interleaves their timed steps (A B A B ...) so drift on a shared machine hits all alike.
"""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import torch

from ..methods import FullBackprop
from ..model.memory import breakdown, peak_rss_mb
from .roofline import ModelShape, StepFlops, plan_for, probe_matmul


def lcsb_worker(conn, recipe_dict: dict) -> None:
    """Steps of the engine's own Trainer (lcsb, full-backprop, freeze, lisa, mezo)."""
    from ..recipe import recipe_from_dict
    from ..run.engine import build_trainer

    recipe = recipe_from_dict(recipe_dict)
    trainer, loaded, _ = build_trainer(recipe)
    trainer.begin()
    shape = ModelShape.of(loaded.model.config, recipe)
    flops = StepFlops(shape, plan_for(recipe, shape.layers))
    conn.send({"setup_mem_mb": peak_rss_mb()})
    while True:
        command, arg = conn.recv()
        if command == "step":
            row = trainer.step(arg)
            batches = [trainer.batches.batch(arg * trainer.grad_accum + i) for i in range(trainer.grad_accum)]
            conn.send({**row, "model_flops": flops.step(batches)})
        # in this process, at its thread count, at the first batch's token count
        elif command == "roofline":
            conn.send(probe_matmul(shape, trainer.batches.batch(0)["input_ids"].numel()))
        elif command == "eval":
            # the frozen weights may be stored in bf16 for the step's autocast (model/precision.py)
            with trainer.backend.autocast(trainer.autocast):
                conn.send(_evaluate(loaded.model, loaded.tokenizer, recipe))
            loaded.model.train()
        elif command == "memory":
            conn.send(breakdown(loaded.model, loaded.probe, loaded.runtime_mb, trainer.backend.held_weights()))
        elif command == "horizon":
            trainer.lr_scheduler = _stretched_schedule(recipe, trainer, arg)
            conn.send(None)
        elif command == "save":
            conn.send(_save(loaded.model, arg))
        else:
            conn.send(None)
            return


def _trainer_batch(rows: list[dict], pad_id: int, collate) -> dict:
    """What the Trainer hands the model: lcsb's batch as the engine feeds it (padded alike; a packed one with its
    documents' position ids, model_inputs), with the labels."""
    from ..model.losses import model_inputs

    batch = collate(rows, pad_id)
    return {**model_inputs(batch), "labels": batch["labels"]}


def hf_trainer_worker(conn, recipe_dict: dict, bf16: bool, total: int) -> None:
    """A plain transformers.Trainer + peft LoRA on the same model and batches, in its default setup (fp32,
    or bf16=True); a callback lets the coordinator start each step and reads its time and loss."""
    import datasets
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from ..data import build_train_batches
    from ..model.load import load_model
    from ..recipe import recipe_from_dict

    recipe = recipe_from_dict(recipe_dict)
    torch.manual_seed(recipe.train.seed)
    loaded = load_model(recipe, torch.device("cpu"))
    stream = build_train_batches(recipe, loaded.tokenizer)
    # the same examples, step for step
    order = [i for step in range(total) for i in stream.indices(step)]
    # the LM head runs on every position in HF's loss
    shape = ModelShape.of(loaded.model.config, recipe)
    flops = StepFlops(shape, FullBackprop.plan(recipe, shape.layers), full_logits=True)

    class Timed(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            conn.recv()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.elapsed = time.perf_counter() - self.start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                step = state.global_step
                rows = [
                    stream.dataset[i]
                    for i in order[(step - 1) * recipe.train.batch_size : step * recipe.train.batch_size]
                ]
                tokens = sum(len(row["input_ids"]) for row in rows)
                conn.send(
                    {
                        "step": step,
                        "loss": logs["loss"],
                        "step_time_s": self.elapsed,
                        "tokens": tokens,
                        "tokens_per_s": tokens / self.elapsed,
                        "peak_mem_mb": peak_rss_mb(),
                        "model_flops": flops.step([stream.collate_fn(rows, loaded.tokenizer.pad_token_id)]),
                    }
                )

    class InOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="lcsb-hf-trainer-"),
        per_device_train_batch_size=recipe.train.batch_size,
        max_steps=total,
        learning_rate=recipe.train.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=recipe.train.seed,
    )
    # what HF Trainer users hand it
    dataset = datasets.Dataset.from_list([stream.dataset[i] for i in order])
    trainer = InOrder(
        model=loaded.model,
        args=args,
        train_dataset=dataset,
        callbacks=[Timed()],
        data_collator=functools.partial(
            _trainer_batch, pad_id=loaded.tokenizer.pad_token_id, collate=stream.collate_fn
        ),
    )
    # its per-step log lines would interleave with the bench display
    trainer.remove_callback(PrinterCallback)
    conn.send({"setup_mem_mb": peak_rss_mb()})
    trainer.train()
    while True:
        command, arg = conn.recv()
        if command == "eval":
            conn.send(_evaluate(loaded.model, loaded.tokenizer, recipe))
        elif command == "save":
            conn.send(_save(loaded.model, arg))
        # HF's own loss and loop: the engine's probes see none of it
        elif command == "memory":
            conn.send(None)
        else:
            conn.send(None)
            return


def _stretched_schedule(recipe, trainer, total: int):
    """The recipe's LR schedule over `total` steps, at the step the trainer has reached (equal-time: the bench sets
    each method's horizon after a probe). Past `total` the rate holds at its last step's value, not cosine's zero."""
    from transformers import get_scheduler

    done = trainer.lr_scheduler.last_epoch
    schedule = get_scheduler(
        recipe.train.lr_scheduler,
        trainer.optimizer,
        num_warmup_steps=recipe.train.warmup_steps,
        num_training_steps=total,
    )
    schedule.lr_lambdas = [functools.partial(_held, rate, total - 1) for rate in schedule.lr_lambdas]
    for _ in range(done):
        schedule.step()
    return schedule


def _held(rate, last: int, step: int) -> float:
    return rate(min(step, last))


def _save(model, path: str) -> str:
    from ..run.resume import save_adapter

    save_adapter(model, Path(path))
    return path


def _evaluate(model, tokenizer, recipe) -> dict:
    from ..data import load_task
    from ..evaluate import evaluate_items, summary_row

    task = load_task(recipe, tokenizer)
    _, metrics = evaluate_items(model, tokenizer, task.need_held_out(), recipe, task.labels)
    return summary_row(metrics)
