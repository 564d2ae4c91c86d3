"""Write the synthetic overnight-personalization samples to recipes/data/personal/.

movies.jsonl: one phone user tagging the movies they watch in a watch-list app, with their own tag habits
(the LaMP-2 domain, so the built-in lamp-tiny base knows the words and the tags; the recipe trains on it).
messages.jsonl: one phone user filing messages into 5 folders; each has its own senders and phrases mixed with
shared filler, and messages from the user's sister nora always go to family, even when they are about work
(all new vocabulary for lamp-tiny: it needs a base model that reads English).
Deterministic: the same --seed gives byte-identical files.
Usage: python tools/build/make_personal_sample.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import synthetic  # noqa: E402

FILE_NAME = "messages.jsonl"
MOVIES_FILE = "movies.jsonl"
USER = "alex"
N_EXAMPLES = 240
DAYS = 14
START = datetime(2026, 11, 16, tzinfo=timezone.utc)
WAKING_HOURS = (7, 23)
HABIT_SENDER = "nora"
# share of messages from nora, always filed under family
HABIT_SHARE = 0.15
# share of nora's messages that are about work
HABIT_WORK_SHARE = 0.6

SENDERS = {
    "work": ("boss kim", "the team lead", "hr office", "client desk", "project board"),
    "family": ("mom", "dad", "grandma", "uncle leo", "cousin sam"),
    "shopping": ("the grocery store", "shoe outlet", "online market", "the pharmacy", "book shop"),
    "travel": ("the airline", "hotel desk", "train service", "car rental", "the travel agent"),
    "finance": ("the bank", "credit card service", "tax office", "insurance company", "savings account"),
}
PHRASES = {
    "work": (
        "the quarterly report is due friday",
        "meeting moved to the big room",
        "review the slides for the client",
        "the project deadline is next week",
        "sign the contract draft before noon",
        "update the team on the budget",
    ),
    "family": (
        "dinner at home on sunday",
        "happy birthday to your little brother",
        "call grandpa after school today",
        "pick up the kids from school",
        "love you and miss you",
        "the family picnic is on saturday",
    ),
    "shopping": (
        "your order has shipped",
        "big sale on winter shoes",
        "your cart is waiting with two items",
        "coupon for half price bread",
        "the parcel arrives tomorrow",
        "new discount on fresh fruit",
    ),
    "travel": (
        "your flight boards at gate twelve",
        "check in for your trip is open",
        "your hotel room is ready",
        "the train to the city is delayed",
        "your seat on the plane is confirmed",
        "pick up the rental car at nine",
    ),
    "finance": (
        "your salary payment arrived",
        "a card payment of forty dollars",
        "your monthly statement is ready",
        "the loan interest rate changed",
        "pay your tax bill by the end of the month",
        "low balance on your account",
    ),
}
PREFIXES = ("message from", "text from", "reminder from", "new note from", "notification from")
SUFFIXES = ("", "", "please reply today", "see you soon", "thanks a lot", "check it when you can", "no rush")
LABEL_WEIGHTS = {"work": 5, "family": 4, "shopping": 4, "travel": 3, "finance": 4}


def _timestamps(rng: random.Random) -> list[str]:
    """N_EXAMPLES distinct minutes in waking hours over DAYS days, oldest first, as ISO strings with Z."""
    first, last = WAKING_HOURS
    minutes = [day * 1440 + hour * 60 + m for day in range(DAYS) for hour in range(first, last) for m in range(60)]
    picked = sorted(rng.sample(minutes, N_EXAMPLES))
    return [(START + timedelta(minutes=m)).strftime("%Y-%m-%dT%H:%M:%SZ") for m in picked]


def _message(rng: random.Random) -> tuple[str, str]:
    """(text, label) for one message; the label distribution does not change over time."""
    if rng.random() < HABIT_SHARE:
        topic = "work" if rng.random() < HABIT_WORK_SHARE else "family"
        sender, label = HABIT_SENDER, "family"
    else:
        labels = list(LABEL_WEIGHTS)
        topic = label = rng.choices(labels, weights=[LABEL_WEIGHTS[x] for x in labels])[0]
        sender = rng.choice(SENDERS[topic])
    text = " ".join(
        part for part in (rng.choice(PREFIXES), sender, rng.choice(PHRASES[topic]), rng.choice(SUFFIXES)) if part
    )
    return text, label


def generate(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for index, timestamp in enumerate(_timestamps(rng), start=1):
        text, label = _message(rng)
        examples.append({"id": f"m{index:04d}", "text": text, "label": label, "timestamp": timestamp, "user": USER})
    return examples


def generate_movies(seed: int = 0) -> list[dict]:
    """The watch-list log: each movie's description and the tag this user gave it (their habit, 10% noise)."""
    rng = random.Random(seed)
    builder = synthetic._Builder(seed + 1)
    habit, weights = synthetic._user(builder.rng)
    examples = []
    for index, timestamp in enumerate(_timestamps(rng), start=1):
        text, label = builder.item(habit, weights)
        examples.append({"id": f"w{index:04d}", "text": text, "label": label, "timestamp": timestamp, "user": USER})
    return examples


def _write(path: Path, examples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(example) + "\n" for example in examples), encoding="utf-8")
    return path


def write_sample(out_dir: Path, seed: int = 0) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / MOVIES_FILE, generate_movies(seed))
    return _write(out_dir / FILE_NAME, generate(seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "data" / "personal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_sample(args.out, args.seed)
    for name in (MOVIES_FILE, FILE_NAME):
        print(f"wrote {args.out / name} ({(args.out / name).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
