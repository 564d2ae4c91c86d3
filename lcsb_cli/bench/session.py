"""One seed of `lcsb bench`: a worker process per method, their steps interleaved under the step or time budget."""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
from pathlib import Path

from ..methods import FullBackprop
from ..recipe import Recipe, to_dict

# full backprop without checkpointing: its label is its name
BASELINE = FullBackprop.name
# transformers' Trainer + peft, the users' alternative: a bench baseline, not one of the engine's methods
HF_TRAINER = "hf-trainer"
HF_TRAINER_BF16 = f"{HF_TRAINER}:bf16"
HF_TRAINER_LABELS = (HF_TRAINER, HF_TRAINER_BF16)
BUDGETS = ("equal-steps", "equal-time")
# equal-time: timed steps of every method before each one's LR horizon is set
PROBE_STEPS = 3


def split_variant(name: str) -> tuple[str, list[str]]:
    """`METHOD@KEY=VALUE,KEY=VALUE` (a method run with recipe overrides, e.g. `lcsb:4@lora.rank=64`) ->
    (METHOD, [KEY=VALUE, ...])."""
    method, _, overrides = name.partition("@")
    return method, [item for item in overrides.split(",") if item]


def is_hf_trainer(name: str) -> bool:
    """`hf-trainer` or `hf-trainer:bf16`, with or without @KEY=VALUE overrides."""
    return split_variant(name)[0] in HF_TRAINER_LABELS


def hf_trainer_bf16(name: str) -> bool:
    """`hf-trainer:bf16`, with or without @KEY=VALUE overrides: Trainer's bf16=True."""
    return split_variant(name)[0] == HF_TRAINER_BF16


def run_session(
    recipes: dict[str, Recipe],
    steps: int,
    warmup: int,
    budget: str,
    evaluate: bool,
    adapters: Path | None,
    display=None,
    probe: bool = False,
) -> tuple[dict[str, dict], dict | None]:
    """Each method's step rows, eval (with `evaluate`; its adapter saved under `adapters`) and memory breakdown;
    with `probe`, the machine's matmul limits, measured before any step by the first worker (the recipe's own
    method: always one of the engine's, never hf-trainer)."""
    workers = {name: _Worker(name, recipe, warmup + steps) for name, recipe in recipes.items()}
    try:
        for worker in workers.values():
            worker.setup = worker.receive()
        limits = next(iter(workers.values())).ask("roofline", None) if probe else None
        for _ in range(warmup):
            _round(workers.values(), display)
        if budget == "equal-steps":
            for _ in range(steps):
                _round(workers.values(), display)
        else:
            _equal_time(workers, steps, warmup, display)
        memory = {name: worker.ask("memory", None) for name, worker in workers.items()}
        evals = {name: _evaluate(worker, adapters, display) if evaluate else None for name, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    return {
        name: {"rows": w.rows, "timed": w.rows[warmup:], "eval": evals[name], "memory": memory[name]}
        for name, w in workers.items()
    }, limits


def _equal_time(workers: dict, steps: int, warmup: int, display) -> None:
    """Full backprop takes `steps` timed steps; every other method steps while its timed steps' total is under the
    target, full backprop's total (projected from its median until it is done), so each ends within one step of it.
    After a short probe each method's LR schedule is stretched to the steps its median predicts."""
    full = workers[BASELINE]
    for _ in range(min(PROBE_STEPS, steps)):
        _round(workers.values(), display)
    predicted = steps * _median_step(full, warmup)
    for name, worker in workers.items():
        if name != BASELINE:
            worker.ask("horizon", warmup + max(1, round(predicted / _median_step(worker, warmup))))
    while True:
        done = len(full.rows) - warmup
        target = _spent(full, warmup) + (steps - done) * _median_step(full, warmup)
        going = [w for name, w in workers.items() if (done < steps if name == BASELINE else _spent(w, warmup) < target)]
        if not going:
            return
        _round(going, display)


def _round(workers, display) -> None:
    # interleaved: A B C A B C ...
    for worker in workers:
        row = worker.ask("step", len(worker.rows))
        worker.rows.append(row)
        if display:
            display(worker.name, row)


def _spent(worker, warmup: int) -> float:
    return sum(row["step_time_s"] for row in worker.rows[warmup:])


def _median_step(worker, warmup: int) -> float:
    return statistics.median(row["step_time_s"] for row in worker.rows[warmup:])


def _evaluate(worker, adapters: Path | None, display) -> dict:
    if display:
        display(worker.name, None)
    if adapters is not None:
        worker.ask("save", str(adapters / adapter_dir_name(worker.name)))
    return worker.ask("eval", None)


def adapter_dir_name(method: str) -> str:
    return method.replace(":", "-")


class _Worker:
    def __init__(self, name: str, recipe: Recipe, total_steps: int):
        from .workers import hf_trainer_worker, lcsb_worker

        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        if is_hf_trainer(name):
            target, args = hf_trainer_worker, (child, to_dict(recipe), hf_trainer_bf16(name), total_steps)
        else:
            target, args = lcsb_worker, (child, to_dict(recipe))
        self.process = context.Process(target=target, args=args, daemon=True)
        self.process.start()
        self.rows: list[dict] = []
        self.setup: dict = {}

    def ask(self, command: str, arg):
        self.conn.send((command, arg))
        return self.receive()

    def receive(self):
        try:
            if self.conn.poll(3600):
                return self.conn.recv()
        except EOFError:
            pass
        raise RuntimeError(f"the bench worker for {self.name} stopped (its error is printed above)")

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(("stop", None))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
