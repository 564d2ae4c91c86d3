"""Deterministic synthetic LaMP-2 sample data and tokenizer-training text (stdlib random only).

Each blurb carries cues from one cue group; a group maps to 2-3 plausible tags and every user has a
fixed habit of picking one of them (with ~10% noise), so the labels are personal as in LaMP-2.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

from lcsb_cli.data.lamp2 import ANSWER_CUE, TAGS, format_input, profile_statement

N_USERS = 30
TRAIN_PER_USER = 10
DEV_PER_USER = 3
PROFILE_SIZE = (10, 20)
NOISE = 0.1
WORDS = (20, 40)


@dataclass(frozen=True)
class CueGroup:
    # plausible tags, the most common habit first
    tags: tuple[str, ...]
    # verb phrases after "<Name>, a <adj> <job> from <place>,"
    clauses: tuple[str, ...]
    # standalone cue sentences
    sentences: tuple[str, ...]


GROUPS: tuple[CueGroup, ...] = (
    CueGroup(
        ("sci-fi", "action", "thought-provoking"),
        (
            "boards a battered spaceship bound for a distant planet",
            "is abducted by aliens who speak through colored light",
            "builds a robot that slowly learns to lie",
            "wakes up on a space station drifting past Jupiter",
            "repairs a rogue android on a mining colony",
        ),
        (
            "Lasers, starships and a cold galaxy fill the screen.",
            "An alien mothership hangs over the city.",
            "A wormhole opens somewhere beyond Saturn.",
            "The robots are always watching.",
        ),
    ),
    CueGroup(
        ("dystopia", "social commentary", "sci-fi"),
        (
            "lives in a grim future city where water is rationed",
            "works for a surveillance state that watches every citizen",
            "escapes a walled megacity ruled by a single party",
            "hides from police drones in a city where books are banned",
        ),
        (
            "Cameras track every street and every thought.",
            "The ministry decides who eats.",
            "Curfew sirens wail each night over the gray towers.",
        ),
    ),
    CueGroup(
        ("based on a book", "classic", "romance"),
        (
            "leads this faithful adaptation of the celebrated novel",
            "anchors a film adapted from the bestselling book",
            "steps out of the pages of a beloved novel",
        ),
        (
            "The film is adapted from the novel by a famous author.",
            "Readers of the book will recognize every chapter.",
            "The screenplay follows the original novel closely.",
        ),
    ),
    CueGroup(
        ("comedy", "romance"),
        (
            "stumbles through hilarious mishaps at a chaotic wedding",
            "pretends to be a famous chef to impress the neighbors",
            "accidentally swaps lives with a goofy twin",
        ),
        (
            "Slapstick gags and silly pranks come thick and fast.",
            "Everything that can go wrong goes hilariously wrong.",
            "The jokes land one after another.",
        ),
    ),
    CueGroup(
        ("dark comedy", "comedy", "violence"),
        (
            "tries to hide a body during a family funeral that goes hilariously wrong",
            "becomes a hitman with a deadpan sense of humor",
            "plans the perfect murder of a rude landlord and bungles every step",
        ),
        (
            "The humor is pitch black.",
            "Corpses pile up in the most absurd ways.",
            "Morbid jokes follow every bad decision.",
        ),
    ),
    CueGroup(
        ("action", "violence"),
        (
            "races through car chases and explosions to stop a heist",
            "fights a private army across rooftops and speeding trains",
            "leads a daring rescue under heavy gunfire",
        ),
        (
            "The stunts are huge and the explosions bigger.",
            "Shootouts and fistfights never let up.",
            "One chase follows another at full speed.",
        ),
    ),
    CueGroup(
        ("violence", "action", "dark comedy"),
        (
            "is dragged into a brutal gang war over the docks",
            "seeks bloody revenge on the cartel that killed a brother",
            "survives a savage massacre in a border town",
        ),
        (
            "The bloodshed is graphic and relentless.",
            "Knives, guns and broken bones mark every scene.",
            "Few characters survive the carnage.",
        ),
    ),
    CueGroup(
        ("psychology", "thought-provoking", "twist ending"),
        (
            "loses all memory after an accident and doubts every friend",
            "sees a therapist about voices that will not go away",
            "slowly unravels under obsession and paranoia",
        ),
        (
            "The camera stays inside a troubled mind.",
            "Trauma and guilt shape each choice.",
            "Dreams and memories blur together.",
        ),
    ),
    CueGroup(
        ("twist ending", "psychology", "thought-provoking"),
        (
            "investigates a disappearance where nothing is what it seems",
            "narrates a story that hides a shocking secret until the last scene",
            "follows clues toward a final revelation that changes everything",
        ),
        (
            "The last ten minutes turn the whole story upside down.",
            "Nobody sees the final reveal coming.",
            "Every clue points the wrong way.",
        ),
    ),
    CueGroup(
        ("fantasy", "based on a book", "action"),
        (
            "becomes the apprentice of a wizard in an enchanted forest",
            "must slay a dragon to save a cursed kingdom",
            "finds a magic sword under an ancient castle",
        ),
        (
            "Elves, spells and talking beasts fill the realm.",
            "An old prophecy foretells the coming of a chosen one.",
            "Magic runs through every river of the kingdom.",
        ),
    ),
    CueGroup(
        ("romance", "comedy"),
        (
            "falls in love with a stranger during one rainy summer",
            "rekindles a romance with a childhood sweetheart",
            "writes love letters to a pen pal across the sea",
        ),
        (
            "Their first kiss comes under the city lights.",
            "Hearts break and mend all summer long.",
            "It is a tender love story.",
        ),
    ),
    CueGroup(
        ("true story", "social commentary", "based on a book"),
        (
            "lived through the real events this film recounts",
            "is the real person behind this true account of a mine collapse",
            "survived the real shipwreck that this film retells",
        ),
        (
            "The film is based on real events.",
            "It retells a true account from the records of the time.",
            "Archive footage of the real people closes the film.",
        ),
    ),
    CueGroup(
        ("classic", "romance"),
        (
            "stars in this black-and-white picture from the golden age of Hollywood",
            "sings and dances through a beloved 1940s musical",
            "waits at a foggy train station in this timeless old melodrama",
        ),
        (
            "It is a timeless black-and-white gem.",
            "Generations of critics have called it a masterpiece.",
            "The film premiered more than seventy years ago.",
        ),
    ),
    CueGroup(
        ("social commentary", "thought-provoking", "true story"),
        (
            "fights a corrupt system that jails the poor",
            "confronts racial injustice in a small southern town",
            "organizes a strike against a factory that exploits its workers",
        ),
        (
            "Poverty and prejudice shape every scene.",
            "The film asks hard questions about class and power.",
            "Inequality is everywhere on the screen.",
        ),
    ),
    CueGroup(
        ("thought-provoking", "psychology", "sci-fi"),
        (
            "questions whether free will exists after meeting a strange child",
            "wonders what makes a life meaningful after a long illness",
            "debates the nature of time with a dying philosopher",
        ),
        (
            "The film leaves more questions than answers.",
            "Ideas about time and identity linger long after.",
            "Its quiet questions stay with the viewer for days.",
        ),
    ),
)

NAMES = (
    "Mara",
    "Tomas",
    "Ines",
    "Jonah",
    "Priya",
    "Felix",
    "Leila",
    "Oskar",
    "Nadia",
    "Ruben",
    "Hana",
    "Victor",
    "Alma",
    "Desmond",
    "Yara",
    "Emil",
    "Sofia",
    "Kwame",
    "Greta",
    "Mateo",
    "Ivy",
    "Arjun",
    "Clara",
    "Hugo",
)
ADJECTIVES = (
    "restless",
    "shy",
    "stubborn",
    "retired",
    "young",
    "weary",
    "ambitious",
    "cheerful",
    "lonely",
    "clever",
    "reckless",
    "gentle",
    "proud",
    "curious",
    "quiet",
)
JOBS = (
    "nurse",
    "taxi driver",
    "teacher",
    "baker",
    "mechanic",
    "journalist",
    "librarian",
    "farmer",
    "pilot",
    "student",
    "lawyer",
    "painter",
    "fisherman",
    "accountant",
    "engineer",
    "waitress",
    "boxer",
    "musician",
)
PLACES = (
    "Lisbon",
    "a small coastal town",
    "Chicago",
    "the mountains",
    "Naples",
    "a quiet suburb",
    "Osaka",
    "the desert",
    "Dublin",
    "a river village",
    "Montreal",
    "the countryside",
    "Berlin",
    "a fishing port",
)
FILLERS = (
    "Along the way {name} must decide who to trust.",
    "The story unfolds over one long {season}.",
    "A {relation} tags along and complicates things.",
    "The soundtrack mixes {music} with quiet piano.",
    "The film moves at a {pace} pace.",
    "{name} keeps a small notebook of everything that happens.",
    "Old friends and new rivals appear at the worst moments.",
    "The supporting cast includes a grumpy neighbor and a loyal dog.",
)
FILL = {
    "season": ("winter", "summer", "autumn", "spring"),
    "relation": ("younger sister", "old friend", "retired uncle", "nosy cousin"),
    "music": ("jazz", "folk songs", "synth pop", "brass bands"),
    "pace": ("slow", "steady", "brisk", "patient"),
}


def blurb(rng: random.Random, group: CueGroup) -> str:
    """A 20-40 word description whose cues all come from ``group``."""
    while True:
        name = rng.choice(NAMES)
        first = f"{name}, a {rng.choice(ADJECTIVES)} {rng.choice(JOBS)} from {rng.choice(PLACES)}, "
        rest = [rng.choice(group.sentences)] if rng.random() < 0.6 else []
        for filler in rng.sample(FILLERS, rng.randint(1, 2)):
            rest.append(filler.format(name=name, **{k: rng.choice(v) for k, v in FILL.items()}))
        rng.shuffle(rest)
        text = " ".join([first + rng.choice(group.clauses) + "."] + rest)
        if WORDS[0] <= len(text.split()) <= WORDS[1]:
            return text


def _habit_tag(rng: random.Random, habit: dict[int, str], group_index: int) -> str:
    options = GROUPS[group_index].tags
    if rng.random() < NOISE:
        return rng.choice([t for t in options if t != habit[group_index]])
    return habit[group_index]


def _user(rng: random.Random) -> tuple[dict[int, str], list[float]]:
    """(habit: group -> preferred tag, how often the user watches each group)."""
    habit = {}
    for g, group in enumerate(GROUPS):
        weights = [0.6] + [0.4 / (len(group.tags) - 1)] * (len(group.tags) - 1)
        habit[g] = rng.choices(group.tags, weights)[0]
    favorites = set(rng.sample(range(len(GROUPS)), 5))
    return habit, [5.0 if g in favorites else 1.0 for g in range(len(GROUPS))]


class _Builder:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seen: set[str] = set()
        self.next_profile_id = 0

    def item(self, habit: dict[int, str], weights: list[float]) -> tuple[str, str]:
        """(unique description, the user's tag for it)."""
        g = self.rng.choices(range(len(GROUPS)), weights)[0]
        text = blurb(self.rng, GROUPS[g])
        while text in self.seen:
            text = blurb(self.rng, GROUPS[g])
        self.seen.add(text)
        return text, _habit_tag(self.rng, habit, g)

    def profile(self, habit: dict[int, str], weights: list[float]) -> list[dict]:
        day = date(2010, 1, 1) + timedelta(days=self.rng.randrange(365))
        items = []
        for _ in range(self.rng.randint(*PROFILE_SIZE)):
            day += timedelta(days=self.rng.randint(20, 120))
            text, tag = self.item(habit, weights)
            items.append(
                {"id": str(300000 + self.next_profile_id), "tag": tag, "description": text, "date": day.isoformat()}
            )
            self.next_profile_id += 1
        return items

    def question(self, qid: str, user_id: str, profile: list[dict], habit, weights) -> tuple[dict, dict]:
        text, tag = self.item(habit, weights)
        tags = list(TAGS)
        self.rng.shuffle(tags)
        question = {"id": qid, "input": format_input(tags, text), "user_id": user_id, "profile": profile}
        return question, {"id": qid, "output": tag}


def generate(seed: int = 0) -> dict[str, object]:
    """The four LaMP-2 files' contents, keyed by file name."""
    builder = _Builder(seed)
    splits: dict[str, tuple[list, list]] = {"train": ([], []), "dev": ([], [])}
    for u in range(N_USERS):
        habit, weights = _user(builder.rng)
        user_id = f"user_{u:02d}"
        profile = builder.profile(habit, weights)
        for split, count, base in (("train", TRAIN_PER_USER, 10000), ("dev", DEV_PER_USER, 20000)):
            questions, golds = splits[split]
            for _ in range(count):
                q, g = builder.question(str(base + len(questions)), user_id, profile, habit, weights)
                questions.append(q)
                golds.append(g)
    files: dict[str, object] = {}
    for split, (questions, golds) in splits.items():
        files[f"{split}_questions.json"] = questions
        files[f"{split}_outputs.json"] = {"task": "LaMP_2", "golds": golds}
    return files


def _dump(payload: object) -> str:
    """Compact JSON with one question / gold per line, so errors and diffs point at a line."""
    if isinstance(payload, list):
        return "[\n" + ",\n".join(json.dumps(q, ensure_ascii=False) for q in payload) + "\n]\n"
    golds = ",\n".join(json.dumps(g, ensure_ascii=False) for g in payload["golds"])
    return f'{{"task": "{payload["task"]}", "golds": [\n{golds}\n]}}\n'


def write_lamp2_sample(out_dir: str | Path, seed: int = 0) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, payload in generate(seed).items():
        path = out / name
        path.write_text(_dump(payload), encoding="utf-8")
        paths.append(path)
    return paths


def corpus_lines(seed: int = 0) -> list[str]:
    """Deterministic tokenizer-training text: blurbs, LaMP prompts with answers, tags, tag statements."""
    files = generate(seed)
    lines: list[str] = list(TAGS)
    profiles = {q["user_id"]: q["profile"] for q in files["train_questions.json"]}
    for item in (item for profile in profiles.values() for item in profile):
        lines.append(item["description"])
        lines.append(profile_statement(item["description"], item["tag"]))
    for split in ("train", "dev"):
        golds = {g["id"]: g["output"] for g in files[f"{split}_outputs.json"]["golds"]}
        for q in files[f"{split}_questions.json"]:
            description = q["input"].split("description: ", 1)[1]
            lines.append(description)
            lines.append(q["input"] + ANSWER_CUE + " " + golds[q["id"]])
            lines.append(profile_statement(description, golds[q["id"]]))
    return lines


def pretrain_documents(seed: int, count: int) -> list[str]:
    """Text for the built-in base model: users' runs of tag statements, LaMP-2 questions answered with
    a user's tag, and plain blurbs.

    Users here are fresh (another seed than the sample's), so the base learns the cue -> tag habits of a
    population, the question format, and, from each run of statements' consistent habit, to follow a user's
    earlier statements. It never sees a question next to its asker's statements: using a user's profile for a
    question is what personalization (profile retrieval, per-user fine-tuning) adds.
    """
    builder = _Builder(seed + 7919)
    docs = []
    for _ in range(count):
        kind = builder.rng.random()
        if kind < 0.2:
            docs.append(blurb(builder.rng, builder.rng.choice(GROUPS)))
            continue
        habit, weights = _user(builder.rng)
        if kind < 0.45:
            text, tag = builder.item(habit, weights)
            tags = list(TAGS)
            builder.rng.shuffle(tags)
            docs.append(format_input(tags, text) + ANSWER_CUE + " " + tag)
            continue
        items = [builder.item(habit, weights) for _ in range(builder.rng.randint(2, 5))]
        docs.append("\n".join(profile_statement(text, tag) for text, tag in items))
    return docs
