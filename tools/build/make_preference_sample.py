"""Write the preference samples into recipes/data/prefs/: one phone user, Lena, who sends the short, informal reply
a suggestion keyboard offers and deletes the long, formal one.

pairs_train.jsonl, pairs_eval.jsonl: {"id", "prompt", "chosen", "rejected"}: the prompt is a message she received
("Reply to Sam: are we still on for 7?"), chosen her kind of reply ("yep, see you at 7!"), rejected the formal
suggestion she deleted. The eval messages are other messages (other senders, times and places in other templates):
held out by user turn, no eval prompt is a training prompt.
feedback_train.jsonl, feedback_eval.jsonl: the same suggestions as thumbs up / down, {"id", "prompt", "completion",
"label"}: each pair's two replies as two unpaired examples (the feedback version of the same user).
Deterministic: the same --seed gives byte-identical files.
Usage: python tools/build/make_preference_sample.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SENDERS = ["Sam", "Mia", "Jonas", "Priya", "Tom", "Aisha", "Leo", "Nora", "Ben", "Chloe", "Omar", "Ivy"]
PLACES = ["the cafe", "the gym", "the station", "Mia's place", "the park", "the cinema", "the office", "the market"]
TIMES = ["7", "8", "half 6", "noon", "9", "5"]
# (message, her reply, the formal suggestion she deleted); eval uses the last two templates only
TEMPLATES = [
    (
        "are we still on for {t} at {p}?",
        "yep, see you at {t}!",
        "Dear {s}, thank you for your message. I would like to confirm that our meeting at {p} at {t} remains "
        "scheduled. I look forward to seeing you there. Kind regards, Lena",
    ),
    (
        "running late, sorry!",
        "no worries, take your time",
        "Dear {s}, thank you for letting me know. Please do not worry about the delay; I will wait for you at {p}. "
        "Kind regards, Lena",
    ),
    (
        "can you grab milk on the way?",
        "sure thing",
        "Dear {s}, certainly. I will purchase milk on my way home and bring it with me. Please let me know if there "
        "is anything else you require. Best regards, Lena",
    ),
    (
        "happy birthday!!",
        "aw thanks!! x",
        "Dear {s}, thank you very much for your kind birthday wishes. I truly appreciate you thinking of me on this "
        "occasion. Warm regards, Lena",
    ),
    (
        "did you see the game last night?",
        "haha yes, crazy ending",
        "Dear {s}, yes, I did watch the game yesterday evening. It was indeed a remarkable conclusion to the match. "
        "Best regards, Lena",
    ),
    (
        "want to get food at {p} later?",
        "ooh yes, {t}?",
        "Dear {s}, thank you for the kind invitation. I would be delighted to join you for a meal at {p}. Would {t} "
        "be convenient for you? Kind regards, Lena",
    ),
    (
        "thanks for today :)",
        "anytime :)",
        "Dear {s}, you are most welcome. It was a pleasure to spend the day with you, and I hope we can do so again "
        "soon. Kind regards, Lena",
    ),
    (
        "can we move to {t}?",
        "{t} works!",
        "Dear {s}, thank you for your message. Moving our plans to {t} is perfectly acceptable to me. I will adjust "
        "my schedule accordingly. Best regards, Lena",
    ),
]
TRAIN_TEMPLATES, N_TRAIN, N_EVAL = 6, 180, 48


def pairs(rng: random.Random, templates: list, n: int, prefix: str) -> list[dict]:
    out, seen = [], set()
    while len(out) < n:
        message, mine, formal = rng.choice(templates)
        values = {"s": rng.choice(SENDERS), "p": rng.choice(PLACES), "t": rng.choice(TIMES)}
        prompt = f"Reply to {values['s']}: {message.format(**values)}"
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append(
            {
                "id": f"{prefix}-{len(out)}",
                "prompt": prompt,
                "chosen": mine.format(**values),
                "rejected": formal.format(**values),
            }
        )
    return out


def feedback(rng: random.Random, items: list[dict]) -> list[dict]:
    """Both replies of each pair as unpaired examples, shuffled (a row's KL partner is then another prompt's)."""
    rows = [
        {"id": f"{item['id']}-{kind}", "prompt": item["prompt"], "completion": item[kind], "label": kind == "chosen"}
        for item in items
        for kind in ("chosen", "rejected")
    ]
    rng.shuffle(rows)
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "data" / "prefs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    train = pairs(rng, TEMPLATES[:TRAIN_TEMPLATES], N_TRAIN, "train")
    held_out = pairs(rng, TEMPLATES[TRAIN_TEMPLATES:], N_EVAL, "eval")
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "pairs_train.jsonl", train)
    write(args.out / "pairs_eval.jsonl", held_out)
    write(args.out / "feedback_train.jsonl", feedback(rng, train))
    write(args.out / "feedback_eval.jsonl", feedback(rng, held_out))


if __name__ == "__main__":
    main()
