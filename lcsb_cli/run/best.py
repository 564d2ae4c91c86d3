"""The best adapter and early stopping (train.keep_best, train.early_stopping_patience): what the held-out losses of a
run's evaluations have shown so far, kept in every checkpoint so a resumed run decides as the whole run would."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from peft import get_peft_model_state_dict

# Run.stopped's value for a run that early stopping ended: a finished run, not an interrupted one
EARLY_STOPPING = "early_stopping"


@dataclass
class BestWatch:
    """The lowest held-out loss so far, its step, its adapter (`keep`: a CPU copy of the LoRA tensors) and the
    evaluations since the last improvement of at least `min_delta` (`patience` of them, when above 0, stop the run).

    An evaluation is an improvement when its loss is below the best so far; it resets the patience count when it is
    below by at least `min_delta` (with min_delta 0: any drop). A NaN loss never improves."""

    keep: bool
    patience: int
    min_delta: float
    best_loss: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    adapter: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def for_recipe(cls, train) -> BestWatch | None:
        if not (train.keep_best or train.early_stopping_patience):
            return None
        return cls(train.keep_best, train.early_stopping_patience, train.early_stopping_min_delta)

    @property
    def exhausted(self) -> bool:
        return bool(self.patience) and self.bad_evals >= self.patience

    def update(self, step: int, loss: float, model) -> None:
        """One evaluation's held-out loss at `step`; `model`'s adapter is copied when it is the best so far."""
        improved = not math.isnan(loss) and (self.best_loss is None or loss < self.best_loss)
        enough = improved and (self.best_loss is None or self.best_loss - loss >= self.min_delta)
        self.bad_evals = 0 if enough else self.bad_evals + 1
        if improved:
            self.best_loss, self.best_step = loss, step
            if self.keep:
                self.adapter = adapter_copy(model)

    def reason(self) -> str:
        return (
            f"eval_loss did not improve by at least {self.min_delta:g} in {self.bad_evals} evaluations "
            f"(best {self.best_loss:.4f} at step {self.best_step})"
        )

    def state_dict(self) -> dict:
        """Plain values and tensors: a checkpoint's state.pt loads it with weights_only=True."""
        return {
            "best_loss": self.best_loss,
            "best_step": self.best_step,
            "bad_evals": self.bad_evals,
            "adapter": self.adapter,
        }

    def load_state_dict(self, state: dict) -> None:
        self.best_loss, self.best_step = state["best_loss"], state["best_step"]
        self.bad_evals, self.adapter = int(state["bad_evals"]), state["adapter"]

    def summary(self) -> dict:
        return {"best_step": self.best_step, "best_eval_loss": self.best_loss}


def adapter_copy(model) -> dict[str, torch.Tensor]:
    """The model's LoRA tensors as peft saves them, copied to the CPU."""
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
