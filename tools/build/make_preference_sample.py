"""Write the preference samples into recipes/data/prefs/: one phone user, Lena, who sends the casual reply a
suggestion keyboard offers and deletes the stiff, formal one.

pairs_train.jsonl, pairs_eval.jsonl: {"id", "prompt", "chosen", "rejected"}: the prompt is a message she received
("Reply to Sam: are we still on for 7 at the cafe?"), chosen her kind of reply ("yep, still on! see you at the cafe at
7"), rejected the formal suggestion she deleted ("I hereby confirm our appointment at the cafe at 7."). The eval
messages are other messages (other senders, times and places in other templates): held out by user turn, no eval
prompt is a training prompt. The base must not already hold the preference: SmolLM2's held-out likelihood accuracy
is 0.479 (tests/test_preference_eval.py keeps it near chance); the phrasings were picked with the base's score of
each in view.
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
# (message, her replies, the formal suggestions she deleted); eval uses the last two templates only. Each side has
# four phrasings of about the same length in tokens as the other side's, so that the pairs differ in register, not in
# length: under any base a longer reply has a higher mean per-token log-prob and a lower total, which would make
# "short over long" a preference the base already holds (or already refuses), whichever way it is scored.
TEMPLATES = [
    (
        "are we still on for {t} at {p}?",
        [
            "yep, still on! see you at {p} at {t}",
            "yes!! {t} at {p}, can't wait to see you",
            "yep, I'll be at {p} at {t}, see you there",
            "of course, see you at {t}! I'll be the one by the door",
        ],
        [
            "Affirmative; our rendezvous at {p} at {t} stands as arranged.",
            "I hereby confirm our appointment at {p} at {t}.",
            "Our engagement at {p} at {t} remains unaltered, I assure you.",
            "Indeed; I shall present myself at {p} promptly at {t}.",
        ],
    ),
    (
        "running late, sorry!",
        [
            "no worries, take your time, I'm just getting a coffee",
            "all good! I'm at {p}, no rush at all",
            "haha no stress, I'm running late too",
            "totally fine, see you when you get here",
        ],
        [
            "Your tardiness is duly noted; I shall remain at {p} pending your arrival.",
            "Kindly be advised that I shall await your arrival at {p}.",
            "The delay is of no consequence; I shall wait at {p} forthwith.",
            "Please accept my assurance that the delay occasions no inconvenience.",
        ],
    ),
    (
        "can you grab milk on the way?",
        [
            "sure thing, do we need anything else?",
            "yep, I'll grab some on the way home",
            "ok! I'll pick some up, anything else?",
            "sure, I'll get milk and maybe some cookies too",
        ],
        [
            "Of course; I shall acquire the requested dairy product en route.",
            "Very well. I shall procure the milk during my return journey.",
            "I shall endeavour to obtain milk prior to my arrival.",
            "Your request for milk is noted; I shall attend to it forthwith.",
        ],
    ),
    (
        "happy birthday!!",
        [
            "aw thank you so much, you're the best!",
            "thanks!! can't believe I'm getting so old haha",
            "thank you!! see you at the party later?",
            "aww thanks, that's so sweet of you",
        ],
        [
            "I am most grateful for your kind felicitations on this occasion.",
            "Your birthday felicitations are received with gratitude.",
            "Please accept my sincere thanks for your gracious birthday wishes.",
            "I extend my gratitude for your thoughtful acknowledgement of my birthday.",
        ],
    ),
    (
        "did you see the game last night?",
        [
            "yes!! what a crazy ending, I couldn't believe it",
            "haha yes, I was screaming at the tv the whole time",
            "yeah, so good! that last goal though",
            "yes, what a game, I can't stop thinking about it",
        ],
        [
            "Indeed, I observed the match; its denouement was most remarkable.",
            "I did; the conclusion of the fixture was rather unexpected.",
            "Yes, I witnessed the contest; the final outcome was most extraordinary.",
            "I viewed the match in its entirety; the result was noteworthy.",
        ],
    ),
    (
        "want to get food at {p} later?",
        [
            "yes!! I'm so hungry, what time?",
            "ooh yes, I'd love that! what time works?",
            "yes please, I haven't eaten all day",
            "yes, that sounds great, see you there!",
        ],
        [
            "I should be most pleased to dine with you at {p}; shall we convene at {t}?",
            "Your invitation is accepted; I propose we convene at {p} at {t}.",
            "It would be agreeable to dine at {p}; I suggest {t}.",
            "A repast at {p} would be most agreeable; shall we say {t}?",
        ],
    ),
    (
        "thanks for today :)",
        [
            "anytime :) that was so much fun, let's do it again",
            "thank you too! I had the best time",
            "aw same, today was great, see you soon",
            "it was so fun! let's do it again next week",
        ],
        [
            "The gratitude is entirely mutual; I found our excursion most agreeable.",
            "It was my pleasure; I trust we shall repeat the occasion.",
            "I likewise extend my thanks for a most agreeable day.",
            "Your gratitude is appreciated; the day was highly satisfactory.",
        ],
    ),
    (
        "can we move to {t}?",
        [
            "sure, {t} is fine with me!",
            "yeah, {t} is better for me anyway",
            "of course, {t} is perfect",
            "yes, {t} works, see you then!",
        ],
        [
            "I consent to rescheduling our engagement to {t}.",
            "Very well; I shall amend my schedule to accommodate {t}.",
            "The proposed alteration to {t} is acceptable to me.",
            "I acquiesce to the postponement of our appointment until {t}.",
        ],
    ),
]
TRAIN_TEMPLATES, N_TRAIN, N_EVAL = 6, 180, 48


def pairs(rng: random.Random, templates: list, n: int, prefix: str) -> list[dict]:
    out, seen = [], set()
    while len(out) < n:
        message, mine, formal = rng.choice(templates)
        mine, formal = rng.choice(mine), rng.choice(formal)
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
