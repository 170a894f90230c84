"""Haystacks for the generated tasks: RULER's repeated "noise" sentences, or sentences of the offline corpus.

`haystack_units(kind, rng)` returns a list of text units (sentences) in order; tasks take a prefix of it that fills
their token budget and put their needles between units. "pydoc" starts at a random sentence of Python's own help
topics (`hf_kvcache.sharing.corpus`, real English, no download) and wraps around; "noise" is RULER's
"The grass is green. The sky is blue. ..." repeated.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

HAYSTACKS = ("noise", "pydoc")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: units handed out at most (a 16K-token context needs ~1500 pydoc sentences)
MAX_UNITS = 4000


@lru_cache(maxsize=1)
def _pydoc_sentences() -> tuple[str, ...]:
    from ...sharing.corpus import pydoc_text

    text = re.sub(r"\s+", " ", pydoc_text())
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    return tuple(s for s in sentences if 20 <= len(s) <= 400)


def haystack_units(kind: str, rng: random.Random, n: int = MAX_UNITS) -> list[str]:
    if kind not in HAYSTACKS:
        raise ValueError(f"`haystack` must be one of {HAYSTACKS}, got {kind!r}.")
    if kind == "noise":
        return [NOISE] * n
    sentences = _pydoc_sentences()
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(n)]


def weave(units: list[str], needles: list[str], depths: list[float]) -> str:
    """The units joined by spaces with each needle inserted before unit round(depth x len(units))."""
    at: dict[int, list[str]] = {}
    for needle, depth in zip(needles, depths):
        at.setdefault(int(round(depth * len(units))), []).append(needle)
    parts = []
    for i in range(len(units) + 1):
        parts.extend(at.get(i, []))
        if i < len(units):
            parts.append(units[i])
    return " ".join(parts)
