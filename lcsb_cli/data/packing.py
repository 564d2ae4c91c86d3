"""data.packing: training rows concatenated into rows of at most `data.max_length` tokens, each document kept apart.

The documents are the training rows in the data's order: a completion or chat row is one document; text rows are
windows of one token stream, and their `segments` (data/lm.py) give back the documents they cut, so packed text
trains on exactly the tokens the windows hold. Packing is greedy in that order: a document joins the current row if
it fits, else it starts the next one; only a document longer than max_length is cut, into max_length pieces, each a
document of its own (completion and chat rows are already cut to max_length when they are read).

A packed row carries `position_ids` that restart at 0 with each document: the model reads the documents from them
(model/losses.py passes them instead of the 2D mask, and transformers builds a block-diagonal causal mask, so
attention never crosses a document). A document's first token is never a target, as it is not in a row of its own:
predicting it would read the document before it. A document with no target left is dropped.

Packing runs once, on the whole training set, before the per-epoch shuffle (batching.py), so batch i is still a
pure function of i and a resumed run continues exactly; held-out rows are never packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

IGNORE = -100


def pack_rows(rows: Sequence[dict], max_length: int) -> list[dict]:
    """Packed rows {id, input_ids, labels, position_ids} of the documents of `rows`, greedily in their order."""
    packed: list[dict] = []
    for document in _pieces(documents(rows), max_length):
        labels = [IGNORE, *document["labels"][1:]]
        if all(label == IGNORE for label in labels):
            continue
        if not packed or len(packed[-1]["input_ids"]) + len(labels) > max_length:
            packed.append({"id": f"pack-{len(packed)}", "input_ids": [], "labels": [], "position_ids": []})
        row = packed[-1]
        row["input_ids"] += document["input_ids"]
        row["labels"] += labels
        row["position_ids"] += range(len(labels))
    return packed


def documents(rows: Iterable[dict]) -> list[dict]:
    """{input_ids, labels} of each document of `rows`, in order. A text window's piece continues the document of the
    piece before it when that is the same document and ends where this piece starts (the two windows are next to
    each other in the stream: a held-out window in between cuts the document)."""
    found: list[dict] = []
    # (document, offset) where the last text piece ended
    end = None
    for row in rows:
        if row.get("segments") is None:
            found.append({"input_ids": list(row["input_ids"]), "labels": list(row["labels"])})
            end = None
            continue
        start = 0
        for document, offset, length in row["segments"]:
            piece = slice(start, start + length)
            if end == (document, offset):
                found[-1]["input_ids"] += row["input_ids"][piece]
                found[-1]["labels"] += row["labels"][piece]
            else:
                found.append({"input_ids": list(row["input_ids"][piece]), "labels": list(row["labels"][piece])})
            end, start = (document, offset + length), start + length
    return found


def _pieces(found: Iterable[dict], max_length: int) -> Iterable[dict]:
    for document in found:
        for start in range(0, len(document["input_ids"]), max_length):
            yield {key: document[key][start : start + max_length] for key in ("input_ids", "labels")}


def padding_share(batches: Iterable[dict]) -> float:
    """Padded positions over all positions of `batches` (collated: attention_mask 1 on real tokens)."""
    real = total = 0
    for batch in batches:
        real += int(batch["attention_mask"].sum())
        total += batch["attention_mask"].numel()
    return 1.0 - real / max(total, 1)
