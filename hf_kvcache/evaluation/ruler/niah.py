"""Needle in a haystack, RULER's variants (Hsieh et al., arXiv 2404.06654, its `niah` task templates).

A needle is "One of the special magic {kind} for {key} is: {value}." hidden in a haystack; the question asks for
every value of the queried key(s), and the answer is scored by how many of them the output contains ("all").
Variants (RULER's names): `single` (one needle), `multikey` (distractor needles with other keys), `multivalue`
(several values for the queried key), `multiquery` (several keys asked at once). Keys are word pairs
("adjective-noun"), numbers or UUID-like strings; values are 7-digit numbers or UUID-like strings.
"""

from __future__ import annotations

import random

from .haystack import haystack_units, weave
from .sample import Sample, fit, rng_for

ADJECTIVES = (
    "able",
    "acid",
    "aged",
    "airy",
    "bald",
    "blue",
    "bold",
    "brave",
    "brief",
    "calm",
    "cheap",
    "clean",
    "cold",
    "cool",
    "damp",
    "dark",
    "dear",
    "deep",
    "dry",
    "dull",
    "eager",
    "early",
    "easy",
    "empty",
    "fair",
    "fast",
    "fine",
    "firm",
    "flat",
    "fond",
    "free",
    "fresh",
    "full",
    "glad",
    "gold",
    "good",
    "grand",
    "gray",
    "great",
    "green",
    "half",
    "hard",
    "high",
    "huge",
    "idle",
    "jolly",
    "keen",
    "kind",
    "large",
    "late",
    "lazy",
    "light",
    "live",
    "long",
    "loud",
    "low",
    "mad",
    "mild",
    "neat",
    "new",
    "nice",
    "odd",
    "old",
    "pale",
    "plain",
    "proud",
    "quick",
    "quiet",
    "rare",
    "raw",
    "real",
    "rich",
    "ripe",
    "rough",
    "round",
    "sad",
    "safe",
    "sharp",
    "short",
    "shy",
    "slow",
    "small",
    "smart",
    "soft",
    "solid",
    "sour",
    "tall",
    "tame",
    "thin",
    "tidy",
    "tiny",
    "tough",
    "vast",
    "warm",
    "weak",
    "wide",
    "wild",
    "wise",
    "young",
    "zany",
)
NOUNS = (
    "actor",
    "anchor",
    "apple",
    "arch",
    "arrow",
    "badge",
    "basket",
    "bell",
    "berry",
    "blade",
    "board",
    "bottle",
    "bridge",
    "brush",
    "bucket",
    "cabin",
    "camera",
    "candle",
    "canal",
    "carpet",
    "castle",
    "chair",
    "chalk",
    "cloud",
    "coast",
    "comet",
    "copper",
    "cotton",
    "desk",
    "diamond",
    "drum",
    "eagle",
    "engine",
    "feather",
    "fence",
    "field",
    "flag",
    "forest",
    "fountain",
    "garden",
    "glove",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "lemon",
    "letter",
    "marble",
    "meadow",
    "mirror",
    "monkey",
    "needle",
    "ocean",
    "orange",
    "oven",
    "paddle",
    "palace",
    "parcel",
    "pencil",
    "pepper",
    "piano",
    "pillow",
    "planet",
    "pocket",
    "puzzle",
    "rabbit",
    "river",
    "rocket",
    "saddle",
    "sail",
    "shadow",
    "shelf",
    "shovel",
    "signal",
    "silver",
    "spider",
    "spoon",
    "stable",
    "statue",
    "stone",
    "sugar",
    "table",
    "temple",
    "ticket",
    "tiger",
    "timber",
    "tower",
    "train",
    "tunnel",
    "valley",
    "violin",
    "wagon",
    "wallet",
    "window",
    "wizard",
    "yard",
)
KEY_KINDS = ("words", "numbers", "uuids")
VALUE_KINDS = ("numbers", "uuids")
#: RULER's `niah` configurations: (haystack, key kind, value kind, keys in the text, values per key, keys asked)
VARIANTS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("pydoc", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("pydoc", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("pydoc", "words", "numbers", 4, 1, 1),
    "niah_multikey_3": ("pydoc", "uuids", "uuids", 4, 1, 1),
    "niah_multivalue": ("pydoc", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("pydoc", "words", "numbers", 4, 1, 4),
}


def _uuid(rng: random.Random) -> str:
    hexits = "0123456789abcdef"
    return "-".join("".join(rng.choice(hexits) for _ in range(n)) for n in (8, 4, 4, 4, 12))


def _key(rng: random.Random, kind: str) -> str:
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    return _uuid(rng)


def _value(rng: random.Random, kind: str) -> str:
    return str(rng.randint(1_000_000, 9_999_999)) if kind == "numbers" else _uuid(rng)


def niah(name: str, context_len: int, seed: int, count) -> Sample:
    """One sample of the RULER variant `name` (see VARIANTS) whose prompt fits `context_len` tokens (`count`: the
    model's token counter)."""
    haystack, key_kind, value_kind, n_keys, n_values, n_queries = VARIANTS[name]
    rng = rng_for(name, context_len, seed)
    keys: list[str] = []
    while len(keys) < n_keys:  # distinct keys
        key = _key(rng, key_kind)
        if key not in keys:
            keys.append(key)
    values = {key: [_value(rng, value_kind) for _ in range(n_values)] for key in keys}
    needles = [(key, value) for key in keys for value in values[key]]
    rng.shuffle(needles)
    depths = [rng.random() for _ in needles]
    thing = "numbers" if value_kind == "numbers" else "uuids"
    asked = keys[:n_queries]
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    header = (
        f"Some special magic {thing} are hidden within the following text. Make sure to memorize it. I will "
        f"quiz you about the {thing} afterwards.\n"
    )
    question = f"\nWhat are all the special magic {thing} for {query} mentioned in the provided text?"
    prefix = f" The special magic {thing} for {query} mentioned in the provided text are"
    units = haystack_units(haystack, rng)
    texts = [f"One of the special magic {thing} for {key} is: {value}." for key, value in needles]

    def build(n: int) -> str:
        return header + weave(units[:n], texts, depths)

    budget = context_len - count(question + prefix) - 2
    n = fit(build, len(units), budget, count)
    answers = [value for key in asked for value in values[key]]
    per_answer = 40 if value_kind == "uuids" else 16  # (a UUID is ~25 tokens of SmolLM2's tokenizer)
    return Sample(
        name,
        build(n),
        question,
        prefix,
        answers,
        "all",
        max_new_tokens=per_answer * len(answers),
        meta={"haystack": haystack, "keys": keys, "asked": asked, "depths": depths, "units": n},
    )
