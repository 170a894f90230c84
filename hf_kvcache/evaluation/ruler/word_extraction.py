"""Aggregation tasks (RULER's `cwe` and `fwe`): find the most common words of a long list.

- `cwe` (common words): a numbered list where 10 words appear often and many others rarely (RULER's 30 and 3 times
  from 4K tokens on; 16 / 2 at 2K and 8 / 1 at 1K, so the common words fit); the question asks for the 10 most
  common words.
- `fwe` (frequent words): a text of coded words drawn from a Zipf distribution (RULER's alpha 2.0) separated by
  "...."; the question asks for the three most frequent.
Both are scored by how many of the reference words the output contains ("all"). The list fills the context, so
every token of it carries the answer: these tasks measure how much of the count survives compression.
"""

from __future__ import annotations

import string

from .niah import ADJECTIVES, NOUNS
from .sample import Sample, fit, rng_for

WORDS = tuple(sorted(set(ADJECTIVES) | set(NOUNS)))
VARIANTS = ("cwe", "fwe")


def common_words(name: str, context_len: int, seed: int, count) -> Sample:
    rng = rng_for(name, context_len, seed)
    words = list(WORDS)
    rng.shuffle(words)
    common, rare = words[:10], words[10:]
    header = (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n"
    )
    question = "\nQuestion: What are the 10 most common words in the above list?"
    prefix = " Answer: The top 10 words that appear most often in the list are:"

    often = max(8, min(30, context_len // 128))
    seldom = 3 if often >= 30 else 2 if often >= 16 else 1

    def listing(n_rare: int) -> list[str]:
        items = common * often + rare[: min(n_rare, len(rare))] * seldom
        order = rng_for(f"{name}-order-{n_rare}", context_len, seed)
        order.shuffle(items)
        return items

    def build(n_rare: int) -> str:
        return header + " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing(n_rare)))

    n = fit(build, len(rare), context_len - count(question + prefix) - 2, count)
    return Sample(
        name,
        build(n),
        question,
        prefix,
        common,
        "all",
        max_new_tokens=60,
        meta={"rare_words": n, "common_frequency": often, "rare_frequency": seldom},
    )


def frequent_words(name: str, context_len: int, seed: int, count) -> Sample:
    rng = rng_for(name, context_len, seed)
    vocabulary: list[str] = []
    while len(vocabulary) < 500:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
        if word not in vocabulary:
            vocabulary.append(word)
    weights = [1.0 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]  # Zipf, alpha 2.0
    stream = rng.choices(vocabulary, weights=weights, k=20000)
    header = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words.\n"
    )
    question = (
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?"
    )
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"

    def build(n: int) -> str:
        return header + " .... ".join(stream[:n])

    n = fit(build, len(stream), context_len - count(question + prefix) - 2, count)
    counts: dict[str, int] = {}
    for word in stream[:n]:
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=lambda w: (-counts[w], w))[:3]
    return Sample(
        name,
        build(n),
        question,
        prefix,
        top,
        "all",
        max_new_tokens=20,
        meta={"words": n, "top_counts": [counts[w] for w in top]},
    )
