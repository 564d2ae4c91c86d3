"""Write the synthetic samples for the text, completion and chat formats into recipes/data/{text,qa,chat}/.

text/train.txt, eval.txt: a field guide to the Tessel Valley, an invented region of six districts. Each district
has fixed traits (river, building stone, crops, market day, craft, dish, festival, greeting, the endings of its
village names) and each habitat fixed ones (districts, season, food, a name prefix such as reed- or crag-); the
entries (villages, species, customs) restate them in varied sentences. eval.txt holds new entries of the same
world, so its perplexity measures learning the world's regularities, not remembering paragraphs.
qa/train.jsonl, eval.jsonl: questions about Marrowby, an invented town (bus lines, opening hours, owners,
streets, weekly events, office holders), {"id", "prompt", "completion"} with short answers. Every fact is asked
in five training phrasings; eval asks each fact once more in a phrasing that no training question uses.
chat/train.jsonl, eval.jsonl: "overnight personalization" as chat: Pip, the phone assistant of one user, Lena,
answers about her life (her dog, partner, gym days, café, allergies, ...) in one warm sentence signed "— Pip".
Eval conversations end with Pip's answer to a question about the same facts, phrased as no training turn is.
Deterministic: the same --seed gives byte-identical files.
Usage: python tools/build/make_text_samples.py [--out DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
# (train, eval) paragraphs
N_TEXT = {"village": (121, 16), "species": (121, 16), "custom": (58, 8)}
# of each fact type's 6 training templates; eval uses one of the type's 2 eval templates
QA_TRAIN_PHRASINGS = 5
CHAT_TRAIN, CHAT_SYSTEM_SHARE, CHAT_ALT_SHARE = 200, 0.3, 0.2
SIGN_OFF = " — Pip"

# ---------------------------------------------------------------- text: the Tessel Valley field guide


class District(NamedTuple):
    name: str
    town: str
    river: str
    stone: str
    crop: str
    day: str
    craft: str
    goods: str
    dish: str
    fest: str
    month: str
    greeting: str
    endings: tuple[str, ...]
    game: str


DISTRICTS = (
    District(
        "Upper Tessel",
        "Skelgill",
        "the upper Tessel",
        "grey slate",
        "rye and hill sheep",
        "Tuesday",
        "felt-making",
        "felt rugs",
        "mutton broth with rye dumplings",
        "Thaw Fair",
        "April",
        "Clear water to you",
        ("thwaite", "gill", "scar"),
        "crag-running",
    ),
    District(
        "the Harl Moors",
        "Harlcote",
        "the Harlbeck",
        "dark gritstone",
        "oats and peat",
        "Thursday",
        "horn-carving",
        "horn combs",
        "oatcakes with peat-smoked ham",
        "Fire Night",
        "November",
        "Warm hearth",
        ("cote", "den", "moor"),
        "peat-ball",
    ),
    District(
        "Sallow Reach",
        "Sallowfleet",
        "the Sallow",
        "reed thatch over timber",
        "eels and willow",
        "Friday",
        "basket-weaving",
        "willow baskets",
        "eel pie",
        "Eel Supper",
        "September",
        "A full net",
        ("fleet", "holm", "ey"),
        "punt racing",
    ),
    District(
        "Orrin Vale",
        "Orrinham",
        "the Orrin",
        "red sandstone",
        "apples and cider pears",
        "Saturday",
        "coppersmithing",
        "copper pans",
        "apple dumplings in cider",
        "Blossom Walk",
        "May",
        "Sweet harvest",
        ("ham", "ley", "combe"),
        "long skittles",
    ),
    District(
        "the Cawdry Hills",
        "Cawdry",
        "the Cawdry Water",
        "white limestone",
        "barley and goats",
        "Monday",
        "cheese-making",
        "wheels of goat's cheese",
        "barley bread with goat's cheese",
        "Cheese Fair",
        "August",
        "High sun",
        ("by", "stone", "low"),
        "wheel-rolling",
    ),
    District(
        "Tessel Mouth",
        "Tesselwick",
        "the Tessel estuary",
        "salt-stained brick",
        "salt and oysters",
        "Wednesday",
        "rope-making",
        "coils of rope",
        "oyster stew",
        "Tide Blessing",
        "June",
        "Fair tide",
        ("wick", "haven", "sands"),
        "tide racing",
    ),
)
PREFIXES = (
    "Ash",
    "Bram",
    "Brock",
    "Cal",
    "Cold",
    "Dun",
    "Elm",
    "Gar",
    "Hol",
    "Kest",
    "Lin",
    "Mor",
    "Nether",
    "Ock",
    "Pell",
    "Quen",
    "Rook",
    "Sel",
    "Thorn",
    "Wend",
    "Yar",
    "Alder",
    "Birk",
    "Crow",
    "Esk",
    "Fox",
    "Gold",
    "Hart",
    "Kel",
    "Lang",
    "Marl",
    "Nab",
    "Oak",
    "Pike",
    "Raven",
    "Tarn",
    "Whin",
    "Yew",
    "Cray",
    "Gisl",
    "Hask",
    "Lud",
    "Mew",
    "Orm",
    "Rush",
    "Stock",
    "Tor",
    "Wyn",
    "Frith",
    "Gorm",
    "Keld",
    "Scal",
    "Swin",
)
INNS = (
    "the Black Ram",
    "the Heron",
    "the Three Keys",
    "the Lantern",
    "the Plough",
    "the Blue Boat",
    "the Old Oak",
    "the Drover's Rest",
    "the Gull",
    "the Wheatsheaf",
    "the Green Man",
    "the Ferryman",
)
LANDMARKS = (
    "an old packhorse bridge",
    "a ruined watermill",
    "a round church tower",
    "a holy well under an ash tree",
    "a standing stone on the green",
    "a tithe barn with a turf roof",
    "a stepped market cross",
    "a row of lime kilns",
    "a chapel built into the hillside",
    "a lych-gate carved with hares",
)
SIZES = {"small": (60, 240), "quiet": (90, 300), "scattered": (120, 400), "compact": (200, 600), "busy": (500, 1400)}
DIRECTIONS = ("north", "south", "east", "west", "north-east", "north-west", "south-east", "south-west")


class Habitat(NamedTuple):
    prefix: str
    long: str
    districts: tuple[str, ...]
    season: str
    food: str
    # where its flowers grow
    ground: str
    trait: str
    kinds: tuple[str, ...]


# prefix, long name, districts, season, animals' food, where flowers grow, trait, kinds
HABITATS = (
    Habitat(
        "reed",
        "reed marshes",
        ("Sallow Reach", "Tessel Mouth"),
        "May to July",
        "reed seeds and small insects",
        "among the sedges",
        "needs standing water and is seldom found away from the reeds",
        ("bird", "moth", "flower", "fish", "mammal"),
    ),
    Habitat(
        "crag",
        "high fells",
        ("Upper Tessel", "the Cawdry Hills"),
        "June to August",
        "mountain grasses and bilberry",
        "in cracks of the scree",
        "keeps to the bare scree above the tree line and is hard to find in mist",
        ("bird", "flower", "moth", "mammal", "beetle"),
    ),
    Habitat(
        "ling",
        "heather moors",
        ("the Harl Moors", "Upper Tessel"),
        "July to September",
        "heather and bilberry",
        "between the heather stems",
        "is found only where the heather is old and deep",
        ("bird", "moth", "flower", "beetle", "mammal"),
    ),
    Habitat(
        "mast",
        "beechwoods",
        ("Orrin Vale", "the Cawdry Hills"),
        "April to June",
        "beech mast and leaf litter",
        "on the beechwood floor",
        "lives in the shade of old beeches and is seldom seen in open country",
        ("bird", "moth", "flower", "mammal", "beetle"),
    ),
    Habitat(
        "gravel",
        "river shallows",
        ("Upper Tessel", "Orrin Vale", "Sallow Reach"),
        "March to May",
        "caddis larvae and water crowfoot",
        "on shingle banks",
        "needs clean water running fast over gravel",
        ("fish", "bird", "flower", "beetle"),
    ),
    Habitat(
        "hay",
        "hay meadows",
        ("Orrin Vale", "Sallow Reach", "the Harl Moors"),
        "May to June",
        "clover and knapweed",
        "among the meadow grasses",
        "vanishes from any meadow that is cut before midsummer",
        ("flower", "bird", "moth", "beetle"),
    ),
)
# kind: (bases, part its name describes, size words)
KINDS = {
    "bird": (("lark", "pipit", "warbler", "chat", "finch"), "back", ("small", "slender", "stocky", "plump")),
    "moth": (("moth", "underwing", "carpet"), "forewings", ("small", "night-flying", "broad-winged")),
    "flower": (("wort", "bell", "campion", "sorrel"), "petals", ("low", "creeping", "tall", "tufted")),
    "fish": (("dace", "loach", "minnow"), "flanks", ("small", "slim", "bottom-feeding")),
    "mammal": (("vole", "shrew", "marten"), "coat", ("small", "shy", "quick")),
    "beetle": (("beetle", "weevil"), "wing cases", ("small", "shining", "long-legged")),
}
ADJECTIVES = (
    "copper",
    "ash-grey",
    "speckled",
    "banded",
    "pale",
    "dusky",
    "golden",
    "rusty",
    "silver",
    "ruddy",
    "blue-grey",
    "striped",
    "sooty",
    "amber",
    "white-spotted",
)
STATUS = (
    "It is common wherever its habitat survives.",
    "It is scarce and is counted every few years.",
    "It is rare, and the valley's naturalists guard its sites.",
    "It is locally common.",
)
# kind: sentences that use the habitat's season and food
KIND_LINES = {
    "bird": ("It breeds from {season} and lays {n} eggs.", "It feeds on {food}."),
    "moth": ("It flies from {season}.", "Its caterpillars feed on {food}."),
    "flower": ("It flowers from {season}.", "It grows {ground}."),
    "fish": ("It spawns from {season}.", "It feeds on {food}."),
    "mammal": ("It raises its young from {season}.", "It feeds mainly on {food}."),
    "beetle": ("Adults are seen from {season}.", "It feeds on {food}."),
}
CUSTOM_KINDS = (
    "festival",
    "dish",
    "craft",
    "greeting",
    "market",
    "houses",
    "wedding",
    "naming",
    "game",
    "river",
    "town",
)


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _village_name(rng: random.Random, district: District, used: set[str]) -> str:
    while True:
        name = rng.choice(PREFIXES) + rng.choice(district.endings)
        if name not in used:
            used.add(name)
            return name


def _village(rng: random.Random, name: str, d: District) -> str:
    size = rng.choice(list(SIZES))
    people = rng.randint(*SIZES[size]) // 10 * 10
    first = f"{name} is a {size} village in {d.name}, {rng.randint(2, 14)} miles {rng.choice(DIRECTIONS)} of {d.town}."
    rest = [
        rng.choice(
            (
                f"It lies on {d.river}.",
                f"The village stands beside {d.river}.",
                f"{_cap(d.river)} runs past the foot of the village.",
            )
        ),
        rng.choice(
            (
                f"Like most places in {d.name}, its houses are built of {d.stone}.",
                f"Its cottages are of {d.stone}, as everywhere in {d.name}.",
                f"The houses are of {d.stone}.",
            )
        ),
        rng.choice((f"Most families live by {d.crop}.", f"The land around it is given to {d.crop}.")),
        rng.choice(
            (
                f"A market is held on the green every {d.day}.",
                f"On {d.day}s the village holds its market.",
                f"Market day is {d.day}, as in the rest of {d.name}.",
            )
        ),
        rng.choice((f"{name} is known for its {d.craft}.", f"Several households still live by {d.craft}.")),
        rng.choice(
            (
                f'Visitors are greeted with "{d.greeting}".',
                f'The usual greeting is "{d.greeting}", and the answer is the same.',
            )
        ),
        f"Its inn, {rng.choice(INNS)}, serves {d.dish}.",
        f"Its best-known sight is {rng.choice(LANDMARKS)}.",
        f"About {people} people live there.",
        rng.choice((f"In {d.month} the village keeps the {d.fest}.", f"The {d.fest} is kept here every {d.month}.")),
    ]
    return " ".join([first] + rng.sample(rest, rng.randint(5, 7)))


def _species_name(rng: random.Random, habitat: Habitat, kind: str, used: set[str]) -> str:
    while True:
        name = f"{rng.choice(ADJECTIVES)} {habitat.prefix}{rng.choice(KINDS[kind][0])}"
        if name not in used:
            used.add(name)
            return name


def _species(rng: random.Random, name: str, habitat: Habitat, kind: str) -> str:
    adjective = name.split()[0]
    places = (
        " and ".join(habitat.districts)
        if len(habitat.districts) == 2
        else f"{habitat.districts[0]}, {habitat.districts[1]} and {habitat.districts[2]}"
    )
    lines = [
        f"The {name} is a {rng.choice(KINDS[kind][2])} {kind} of the {habitat.long}.",
        rng.choice((f"It is found mainly in {places}.", f"In the valley it occurs in {places}.")),
        rng.choice(
            (
                f"Like the other {habitat.prefix}-named species it {habitat.trait}.",
                f"It {habitat.trait}, as the {habitat.prefix}- in its name suggests.",
            )
        ),
    ]
    fill = {"season": habitat.season, "food": habitat.food, "ground": habitat.ground, "n": rng.randint(3, 6)}
    extra = [line.format(**fill) for line in KIND_LINES[kind]]
    extra += [f"Its name comes from its {adjective} {KINDS[kind][1]}.", rng.choice(STATUS)]
    return " ".join(lines + rng.sample(extra, rng.randint(2, len(extra))))


def _custom(kind: str, d: District) -> str:
    return {
        "festival": f"The {d.fest} is the chief feast of {d.name}. It is kept in {d.month} in every village from "
        f"{d.town} outwards, and it ends with {d.dish} shared at long tables.",
        "dish": f"{_cap(d.dish)} is the dish of {d.name}. Every inn from {d.town} to the smallest hamlet has its own "
        f"way of making it, and no {d.fest} is complete without it.",
        "craft": f"{_cap(d.craft)} is the old craft of {d.name}. The work is done in the winter months, and the "
        f"{d.goods} are sold at the {d.day} market in {d.town}.",
        "greeting": f'In {d.name} people greet one another with "{d.greeting}". The answer is the same words said '
        f"back, and a stranger who knows them is made welcome at the {d.fest}.",
        "market": f"Markets in {d.name} are held on {d.day}s. The largest is at {d.town}, where {d.goods} are sold "
        f"beside the produce of the district's {d.crop}.",
        "houses": f"Houses in {d.name} are built of {d.stone}. Even the new houses of {d.town} keep to it, and a "
        f"house of any other material is said to belong to a stranger.",
        "wedding": f"At a wedding in {d.name} the couple are given {d.goods}, and the guests call out "
        f'"{d.greeting}" as they leave. Most weddings fall in the weeks after the {d.fest}.',
        "naming": f"A child born in {d.name} is carried down to {d.river} on the first {d.day} after its birth, "
        f"and its name is spoken over the water before it is spoken anywhere else.",
        "game": f"{_cap(d.game)} is the game of {d.name}. It is played on {d.day} evenings after the market, and the "
        f"great match of the year is held at the {d.fest}.",
        "river": f"{_cap(d.river)} is the river of {d.name}. Its banks feed the district's {d.crop}, and the "
        f"villages along it are built of {d.stone}.",
        "town": f"{d.town} is the chief town of {d.name} and stands on {d.river}. Its {d.day} market is the largest "
        f"in the district, and it keeps the {d.fest} each {d.month}.",
    }[kind]


def text_corpus(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, eval) paragraphs: villages, species and customs; eval's are entries train does not have."""
    rng = random.Random(seed)
    villages, species, used = [], [], set()
    for _ in range(sum(N_TEXT["village"])):
        district = rng.choice(DISTRICTS)
        villages.append(_village(rng, _village_name(rng, district, used), district))
    for _ in range(sum(N_TEXT["species"])):
        habitat = rng.choice(HABITATS)
        kind = rng.choice(habitat.kinds)
        species.append(_species(rng, _species_name(rng, habitat, kind, used), habitat, kind))
    customs = [_custom(kind, d) for d in DISTRICTS for kind in CUSTOM_KINDS]
    rng.shuffle(customs)
    train, held = [], []
    for pool, key in ((villages, "village"), (species, "species"), (customs, "custom")):
        n_train = N_TEXT[key][0]
        train += pool[:n_train]
        held += pool[n_train:]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


# ---------------------------------------------------------------- qa: facts of Marrowby, an invented town

QA_TYPES = {  # type: (train templates, eval templates, {subject: answer})
    "bus": (
        (
            "Which bus goes to the {x}?",
            "What bus line serves the {x}?",
            "Which line do I take to get to the {x}?",
            "What number is the bus to the {x}?",
            "Which bus stops at the {x}?",
            "I need to get to the {x}. Which bus should I take?",
        ),
        (
            "If I want to ride the bus to the {x}, which line do I need?",
            "What's the bus route that runs out to the {x}?",
        ),
        {
            "harbour": "Line 14",
            "hospital": "Line 3",
            "university": "Line 22",
            "train station": "Line 1",
            "old town": "Line 5",
            "beach": "Line 17",
            "zoo": "Line 11",
            "stadium": "Line 8",
            "airport": "Line 30",
            "business park": "Line 26",
        },
    ),
    "hours": (
        (
            "What are the opening hours of the {x}?",
            "When is the {x} open?",
            "What hours does the {x} keep?",
            "From when to when is the {x} open?",
            "What time does the {x} open and close?",
            "When can I visit the {x}?",
        ),
        ("Between which hours can I go to the {x}?", "Tell me the {x}'s hours."),
        {
            "library": "9 am to 5 pm",
            "swimming pool": "7 am to 9 pm",
            "post office": "8 am to 1 pm",
            "museum": "10 am to 6 pm",
            "pharmacy": "8 am to 8 pm",
            "town hall": "9 am to 3 pm",
            "gym": "6 am to 10 pm",
            "bike shop": "10 am to 7 pm",
            "recycling centre": "7 am to 4 pm",
            "cinema box office": "2 pm to 11 pm",
        },
    ),
    "owner": (
        (
            "Who runs the {x}?",
            "Who owns the {x}?",
            "Who is in charge of the {x}?",
            "Whose business is the {x}?",
            "Who manages the {x}?",
            "Who is the owner of the {x}?",
        ),
        ("Which person runs the {x} these days?", "If I want to speak to the boss of the {x}, who do I ask for?"),
        {
            "Copper Kettle bakery": "Maren Holt",
            "Blue Door bookshop": "Idris Vane",
            "fish market": "Tova Lind",
            "Lantern cinema": "Oskar Brandt",
            "dental clinic": "Priya Sen",
            "Sunday Garden nursery": "Elsie Marlow",
            "Old Mill hotel": "Benedek Roth",
            "Saffron Street deli": "Noor Haddad",
            "boatyard": "Callum Reid",
            "Kite Hill riding school": "Ada Fenwick",
        },
    ),
    "street": (
        (
            "Where is the {x}?",
            "On which street is the {x}?",
            "What street is the {x} on?",
            "What is the address of the {x}?",
            "Where can I find the {x}?",
            "Which road is the {x} on?",
        ),
        ("I'm looking for the {x}; which street should I head to?", "In what street will I find the {x}?"),
        {
            "police station": "Mill Lane",
            "youth hostel": "Quay Street",
            "tourist office": "Rowan Avenue",
            "laundrette": "Chapel Row",
            "community garden": "Fisher's Walk",
            "music school": "Kiln Road",
            "vet": "Orchard Close",
            "climbing wall": "Station Parade",
            "flea market": "Bell Street",
            "tool library": "Tanner's Yard",
        },
    ),
    "day": (
        (
            "On which day is the {x}?",
            "What day does the {x} take place?",
            "When is the {x} held?",
            "Which day of the week is the {x}?",
            "What day is the {x} on?",
            "When does the {x} happen each week?",
        ),
        ("If I want to go to the {x}, which day should I come?", "The {x} is on what day of the week?"),
        {
            "farmers' market": "Saturday",
            "quiz night at the Anchor": "Tuesday",
            "chess club": "Thursday",
            "late opening at the museum": "Wednesday",
            "bin collection": "Monday",
            "beach clean-up": "Sunday",
            "choir practice": "Friday",
            "open swim at the lido": "Sunday",
            "street food night": "Friday",
            "repair café": "Wednesday",
        },
    ),
    "role": (
        (
            "Who is the {x} of Marrowby?",
            "Who is Marrowby's {x}?",
            "What is the name of the town's {x}?",
            "Who works as the {x} in Marrowby?",
            "Who is the current {x} of Marrowby?",
            "Which person is the {x}?",
        ),
        ("Do you know who serves as Marrowby's {x}?", "Tell me the name of the person who is the {x}."),
        {
            "mayor": "Greta Fairweather",
            "head librarian": "Samir Okoye",
            "harbour master": "Jonas Penhallow",
            "head teacher": "Ruth Akintola",
            "town doctor": "Dr Wen Li",
            "fire chief": "Marcus Dole",
            "football coach": "Kit Trelawny",
            "postmaster": "Agnes Bellamy",
            "park ranger": "Tomasz Wilk",
            "vicar": "Reverend Hale",
        },
    ),
}


def _qa_row(row_id: str, question: str, answer: str) -> dict:
    return {"id": row_id, "prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}


def qa_pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval): each fact in QA_TRAIN_PHRASINGS training phrasings and one eval phrasing unseen in training."""
    rng = random.Random(seed)
    train, held = [], []
    for kind, (train_templates, eval_templates, facts) in QA_TYPES.items():
        for subject, answer in facts.items():
            slug = f"{kind}-{subject.lower().replace(' ', '-').replace(chr(39), '')}"
            for i, template in enumerate(rng.sample(train_templates, QA_TRAIN_PHRASINGS)):
                train.append(_qa_row(f"{slug}-{i + 1}", template.format(x=subject), answer))
            held.append(_qa_row(f"{slug}-eval", rng.choice(eval_templates).format(x=subject), answer))
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


# ---------------------------------------------------------------- chat: Pip learns Lena's life and style

# fact: (canonical answer, alternative answer, training questions, eval questions)
CHAT_FACTS = {
    "dog": (
        "Your dog is Biscuit, your sweet little beagle!",
        "That's Biscuit, your cheeky beagle!",
        (
            "What's my dog called?",
            "What is my dog's name?",
            "Remind me of my dog's name?",
            "What kind of dog do I have?",
            "Who's my furry friend again?",
            "What breed is my dog?",
        ),
        ("How do I call my pup again?", "Name of my dog, please?", "Which dog lives with me?"),
    ),
    "partner": (
        "Your partner is Tomas, and he adores you!",
        "That's Tomas, your lovely partner!",
        (
            "Who is my partner?",
            "What's my partner's name?",
            "Who am I dating?",
            "Who do I live with?",
            "What's my boyfriend called?",
            "Remind me who my other half is?",
        ),
        ("Who's the person I'm in a relationship with?", "My partner's name again?", "Who shares my flat with me?"),
    ),
    "partner_job": (
        "Tomas works night shifts as a nurse at St Brigid's.",
        "Tomas is a night nurse at St Brigid's.",
        (
            "What does Tomas do for work?",
            "Where does Tomas work?",
            "What is Tomas's job?",
            "Why does Tomas sleep in the day?",
            "Which hospital is Tomas at?",
            "Is Tomas a nurse?",
        ),
        ("What's my partner's profession?", "How does Tomas earn a living?", "Where is my boyfriend employed?"),
    ),
    "gym": (
        "You go to the gym on Mondays and Thursdays, you've got this!",
        "Gym days are Monday and Thursday!",
        (
            "When are my gym days?",
            "Which days do I go to the gym?",
            "Is today a gym day, which days are they?",
            "What days do I work out?",
            "When do I train at the gym?",
            "Remind me of my gym schedule?",
        ),
        (
            "On what days of the week do I exercise?",
            "Which weekdays are my workout days?",
            "When should I pack my gym bag?",
        ),
    ),
    "cafe": (
        "Your favourite café is the Little Fern on Hale Street.",
        "The Little Fern on Hale Street, of course!",
        (
            "What's my favourite café?",
            "Where do I like to get coffee?",
            "Which café do I love?",
            "Where should I meet Ines for coffee?",
            "Which coffee place is my go-to?",
            "What café do I always pick?",
        ),
        ("Which coffee shop do I like best?", "Where's my usual coffee spot?", "Name my top café, please?"),
    ),
    "allergy": (
        "You're allergic to peanuts and penicillin, so please stay safe!",
        "Peanuts and penicillin, so steer clear of both!",
        (
            "What am I allergic to?",
            "Do I have any allergies?",
            "What are my allergies?",
            "Which foods or medicines should I avoid?",
            "Tell me my allergies?",
            "Am I allergic to anything?",
        ),
        (
            "What should I tell the doctor about allergies?",
            "Which allergies do I need to mention?",
            "Is there anything my body reacts badly to?",
        ),
    ),
    "coffee": (
        "You take an oat flat white with no sugar.",
        "An oat flat white, no sugar, just how you like it!",
        (
            "What's my usual coffee order?",
            "How do I take my coffee?",
            "What coffee do I order?",
            "What should I order at the café?",
            "Do I take sugar in my coffee?",
            "What's my coffee?",
        ),
        (
            "What's my regular drink at the café?",
            "How do I like my coffee made?",
            "What should Tomas get me from the café?",
        ),
    ),
    "sister": (
        "Your sister is Ines, and she lives in Porto.",
        "That's Ines, your sister in Porto!",
        (
            "What's my sister's name?",
            "Who is my sister?",
            "Where does my sister live?",
            "Remind me about my sister?",
            "What is Ines to me?",
            "Which city is my sister in?",
        ),
        ("Who's my sibling, and where is she?", "Tell me about my sister, please?", "Where does Ines live these days?"),
    ),
    "birthday": (
        "Your birthday is on the 14th of March!",
        "It's the 14th of March, your special day!",
        (
            "When is my birthday?",
            "What's my date of birth?",
            "When do I celebrate my birthday?",
            "Which day is my birthday?",
            "What day was I born?",
            "Remind me when my birthday is?",
        ),
        (
            "On what date do I turn a year older?",
            "When should people wish me happy birthday?",
            "What date is my birthday on?",
        ),
    ),
    "job": (
        "You're a sound engineer at Harbour Radio.",
        "You work as a sound engineer at Harbour Radio!",
        (
            "What do I do for work?",
            "Where do I work?",
            "What's my job?",
            "What is my profession?",
            "Who is my employer?",
            "What do I do at the radio station?",
        ),
        ("How do I earn my living?", "What's my line of work?", "Which company employs me?"),
    ),
    "commute": (
        "You cycle to work, or take tram 6 when it rains.",
        "By bike, or tram 6 on rainy days!",
        (
            "How do I get to work?",
            "How do I commute?",
            "Which tram do I take when it rains?",
            "Do I bike to work?",
            "What's my commute?",
            "How do I travel to the office?",
        ),
        (
            "What's my way of getting to the office?",
            "It's raining, how do I usually get to work?",
            "How do I normally reach work?",
        ),
    ),
    "mum": (
        "You call your mum Rosa every Sunday evening.",
        "Sunday evenings are for calling your mum Rosa!",
        (
            "When do I call my mum?",
            "What's my mum's name?",
            "Who is Rosa?",
            "When should I phone my mother?",
            "Is it time to call mum, what day do I call?",
            "How often do I ring my mum?",
        ),
        (
            "Which evening do I phone Rosa?",
            "What's my mother called, and when do I call her?",
            "When is my weekly call with my mum?",
        ),
    ),
    "book_club": (
        "Book club is on the first Wednesday of the month.",
        "The first Wednesday of each month!",
        (
            "When is book club?",
            "Which day is my book club?",
            "When does my book club meet?",
            "Is book club this week, when is it?",
            "What day do we do book club?",
            "How often is book club?",
        ),
        (
            "When's the next reading group meeting?",
            "On which day does the book club get together?",
            "When do I meet my book club friends?",
        ),
    ),
    "vet": (
        "Biscuit's vet is Dr Okafor at Elm Street Vets.",
        "Dr Okafor at Elm Street Vets looks after Biscuit!",
        (
            "Who is Biscuit's vet?",
            "Which vet do I take Biscuit to?",
            "What's the name of our vet?",
            "Where is Biscuit's vet?",
            "Biscuit seems ill, which vet do we use?",
            "Who looks after Biscuit?",
        ),
        ("Which animal doctor treats my dog?", "Where do I take my beagle for checkups?", "Who's the vet for my pup?"),
    ),
    "dinner": (
        "Your go-to dinner is mushroom risotto.",
        "Mushroom risotto, your comfort dish!",
        (
            "What's my favourite dinner?",
            "What should I cook tonight?",
            "What's my comfort food?",
            "What do I love to eat?",
            "What's my favourite meal?",
            "What dish do I always make?",
        ),
        ("What do I like to have for supper?", "Which meal cheers me up?", "What food should Tomas make me tonight?"),
    ),
    "cello": (
        "You have cello lessons on Tuesday evenings.",
        "Cello is on Tuesday evenings, enjoy it!",
        (
            "When is my cello lesson?",
            "What instrument do I play?",
            "Which day do I have cello?",
            "When do I practise with my teacher?",
            "Do I have music lessons?",
            "What's on Tuesday evenings?",
        ),
        ("Which evening is my music lesson?", "When do I go to learn the cello?", "What do I do on Tuesday nights?"),
    ),
    "plant": (
        "Your monstera needs watering every Saturday.",
        "Water the monstera on Saturdays!",
        (
            "When do I water my plant?",
            "Which day is plant watering?",
            "How often does the monstera need water?",
            "Did I forget the plant, when do I water it?",
            "When should I water the monstera?",
            "What's my plant routine?",
        ),
        (
            "What day does my big houseplant get water?",
            "When is the monstera's watering day?",
            "How often should I water my houseplant?",
        ),
    ),
}
# (user, assistant) exchanges without a fact
SMALL_TALK = (
    ("Thanks!", "Anytime, Lena!"),
    ("Thank you so much", "Always happy to help, Lena!"),
    ("Good morning!", "Good morning, Lena, I hope you slept well!"),
    ("You're the best", "Aw, you are, Lena!"),
    ("ok great", "Glad that helps, Lena!"),
    ("Goodnight", "Goodnight, Lena, sleep tight!"),
)
SYSTEMS = (
    "You are Pip, Lena's assistant on her phone.",
    "You are Pip. Answer Lena briefly.",
    "Pip, Lena's phone assistant. Be brief and kind.",
)


def _say(answer: str) -> dict:
    return {"role": "assistant", "content": answer + SIGN_OFF}


def _typed(rng: random.Random, question: str) -> str:
    """How a question looks typed on a phone: sometimes lower case, sometimes without the question mark."""
    if rng.random() < 0.25:
        question = question[0].lower() + question[1:]
    if rng.random() < 0.2:
        question = question.rstrip("?")
    return question


def _fact_turns(rng: random.Random, fact: str) -> list[dict]:
    answer, alt, questions, _ = CHAT_FACTS[fact]
    reply = alt if rng.random() < CHAT_ALT_SHARE else answer
    return [{"role": "user", "content": _typed(rng, rng.choice(questions))}, _say(reply)]


def _opening(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < CHAT_SYSTEM_SHARE else []


def _fact_rounds(rng: random.Random, n: int) -> list[str]:
    """n facts in whole shuffled rounds, so every fact is asked about equally often in training."""
    order = []
    while len(order) < n:
        order += rng.sample(list(CHAT_FACTS), len(CHAT_FACTS))
    return order[:n]


def _train_conversation(rng: random.Random, facts: list[str]) -> list[dict]:
    messages = _opening(rng)
    # a fact twice in a row (across two rounds) is asked once
    for fact in dict.fromkeys(facts):
        messages += _fact_turns(rng, fact)
        if rng.random() < 0.15:
            user, reply = rng.choice(SMALL_TALK)
            messages += [{"role": "user", "content": user}, _say(reply)]
    return messages


def chat_conversations(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval); every eval conversation ends with Pip's canonical answer to an eval-only question."""
    rng = random.Random(seed)
    # fact exchanges per conversation
    sizes = [rng.choice((1, 1, 1, 2, 2, 3)) for _ in range(CHAT_TRAIN)]
    order = _fact_rounds(rng, sum(sizes))
    starts = [sum(sizes[:i]) for i in range(CHAT_TRAIN)]
    train = [
        {"id": f"chat-{i + 1:04d}", "messages": _train_conversation(rng, order[start : start + size])}
        for i, (start, size) in enumerate(zip(starts, sizes))
    ]
    held = []
    for fact, (answer, _, _, questions) in CHAT_FACTS.items():
        for i, question in enumerate(questions):
            messages = _opening(rng)
            # a warm-up exchange about another fact first
            if rng.random() < 0.3:
                messages += _fact_turns(rng, rng.choice([f for f in CHAT_FACTS if f != fact]))
            held.append(
                {
                    "id": f"chat-{fact}-eval-{i + 1}",
                    "messages": messages + [{"role": "user", "content": question}, _say(answer)],
                }
            )
    rng.shuffle(held)
    return train, held


# ---------------------------------------------------------------- files


def _check_held_out(train_questions: set[str], held_questions: list[str], what: str) -> None:
    seen = [q for q in held_questions if q.lower().rstrip("?") in train_questions]
    if seen:
        raise AssertionError(f"{what}: eval questions also asked in training: {seen[:3]}")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def _write_text(path: Path, paragraphs: list[str]) -> Path:
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


def write_samples(out_root: Path, seed: int = 0) -> list[Path]:
    for name in ("text", "qa", "chat"):
        (out_root / name).mkdir(parents=True, exist_ok=True)
    text_train, text_eval = text_corpus(seed)
    qa_train, qa_eval = qa_pairs(seed)
    chat_train, chat_eval = chat_conversations(seed)
    _check_held_out({r["prompt"].lower().rstrip("?") for r in qa_train}, [r["prompt"] for r in qa_eval], "qa")
    chat_questions = {
        m["content"].lower().rstrip("?") for r in chat_train for m in r["messages"] if m["role"] == "user"
    }
    _check_held_out(chat_questions, [r["messages"][-2]["content"] for r in chat_eval], "chat")
    return [
        _write_text(out_root / "text" / "train.txt", text_train),
        _write_text(out_root / "text" / "eval.txt", text_eval),
        _write_jsonl(out_root / "qa" / "train.jsonl", qa_train),
        _write_jsonl(out_root / "qa" / "eval.jsonl", qa_eval),
        _write_jsonl(out_root / "chat" / "train.jsonl", chat_train),
        _write_jsonl(out_root / "chat" / "eval.jsonl", chat_eval),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_samples(args.out, args.seed):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
