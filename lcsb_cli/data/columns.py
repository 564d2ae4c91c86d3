"""What a text, completion or chat record holds, whatever its columns are called. The recipe's `data.columns` names
them (role -> column); the layouts peers write are read as axolotl and LLaMA-Factory read them:

- ShareGPT, as chat: the turns under "conversations" (or the messages column) as {"from", "value"}, where from
  human or user is the user, gpt or assistant the assistant, system the system;
- Alpaca, as completion: {"instruction", "input" (optional), "output"}; the prompt is the instruction and the input,
  each followed by a blank line (the separator the completion format wants in its prompt), the completion the output.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..recipe.schema import COLUMN_ROLES

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SHAREGPT = "conversations"
ALPACA = ("instruction", "output")
# the column sets a record may have besides the format's own (its roles but id, as data.columns names them)
PEER_LAYOUTS = {"completion": (ALPACA,), "chat": ((SHAREGPT,),)}
PEER_NAMES = {
    "completion": ' (or Alpaca\'s "instruction", "input", "output")',
    "chat": ' of {"role", "content"} (or ShareGPT\'s "conversations" of {"from", "value"})',
}


@dataclass(frozen=True)
class Shape:
    """The records a format reads: `names` maps each role to its column."""

    format: str
    names: dict[str, str]

    @classmethod
    def of(cls, fmt: str, columns: dict[str, str] | None = None) -> Shape:
        return cls(fmt, {role: role for role in COLUMN_ROLES[fmt]} | dict(columns or {}))

    @property
    def plain_text(self) -> bool:
        return self.format == "text"

    def layouts(self) -> tuple[tuple[str, ...], ...]:
        own = tuple(self.names[role] for role in COLUMN_ROLES[self.format] if role != "id")
        return (own, *PEER_LAYOUTS.get(self.format, ()))

    def fits(self, columns: Collection[str]) -> bool:
        return any(set(layout) <= set(columns) for layout in self.layouts())

    def describe(self) -> str:
        own = " and ".join(f'"{name}"' for name in self.layouts()[0])
        records = f"records with {own}{PEER_NAMES.get(self.format, '')}"
        return f"plain text (.txt) or {records}" if self.plain_text else records

    def item(self, record: dict) -> dict:
        """The record as {"id", "text"}, {"id", "prompt", "completion"} or {"id", "messages": [{"role", "content"}]};
        ValueError naming the column that is wrong."""
        names = self.names
        if self.format == "text":
            body = {"text": _string(record, names["text"])}
        elif self.format == "completion" and names["prompt"] not in record and ALPACA[0] in record:
            body = _alpaca(record)
        elif self.format == "completion":
            body = {"prompt": _string(record, names["prompt"]), "completion": _string(record, names["completion"])}
        else:
            column = names["messages"] if names["messages"] in record or SHAREGPT not in record else SHAREGPT
            body = {"messages": _messages(record, column)}
        return {"id": record.get(names["id"]), **body}


def _string(record: dict, column: str) -> str:
    value = record.get(column)
    if not isinstance(value, str) or not value.strip():
        found = "" if column in record else f" (the record has {', '.join(map(str, record)) or 'no key'})"
        raise ValueError(f'"{column}" must be a non-empty string{found}')
    return value


def _alpaca(record: dict) -> dict:
    given = record.get("input")
    parts = [_string(record, "instruction"), *([given] if isinstance(given, str) and given.strip() else [])]
    return {"prompt": "".join(f"{part}\n\n" for part in parts), "completion": _string(record, "output")}


def _messages(record: dict, column: str) -> list[dict]:
    turns = record.get(column)
    if not isinstance(turns, list) or not turns:
        raise ValueError(f'"{column}" must be a non-empty list of {{"role", "content"}} (or {{"from", "value"}})')
    messages = [_turn(index, turn) for index, turn in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn, so nothing to learn from")
    return messages


def _turn(index: int, turn) -> dict:
    """{"role", "content"}, or ShareGPT's {"from", "value"} with its roles renamed."""
    if isinstance(turn, dict) and turn.get("role") is None and turn.get("from") is not None:
        role, content = SHAREGPT_ROLES.get(turn["from"]), turn.get("value")
        if role is None:
            raise ValueError(
                f'message {index}: "from" is {turn["from"]!r}; a ShareGPT turn is from {", ".join(SHAREGPT_ROLES)}'
            )
    else:
        role, content = (turn.get("role"), turn.get("content")) if isinstance(turn, dict) else (None, None)
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(
            f'message {index} must be an object with string "role" and "content" (or ShareGPT\'s "from", "value")'
        )
    return {"role": role, "content": content}
