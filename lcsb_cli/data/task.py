"""A run's data, loaded once: the one value every format's loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BadInput


@dataclass
class TaskData:
    """Training and held-out items, the label set of a classification task, and the lines skipped under
    data.on_bad_line: skip. Items are LampQuestion (lamp2, jsonl) or token rows {id, input_ids, labels, ...}
    (text, completion, chat); the format's registry entry (data/formats.py) says which."""

    format: str
    train: list
    held_out: list
    labels: tuple[str, ...] | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def need_held_out(self) -> list:
        if not self.held_out:
            raise BadInput(
                "data.eval: no held-out items to evaluate; give data.eval (LaMP-2: a *_questions.json "
                "with data.eval_labels)"
            )
        return self.held_out
