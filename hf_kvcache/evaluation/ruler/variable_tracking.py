"""Variable tracking (RULER's `vt`): follow chains of assignments hidden in a haystack.

"VAR ABCDE = 12345" starts a chain, "VAR FGHIJ = VAR ABCDE" extends it (`hops` times); the question asks for every
variable that holds the chain's value. Distractor chains (`chains` - 1) start from other values. Scored by how many
of the chain's variables the output names ("all").
"""

from __future__ import annotations

import itertools
import string

from .haystack import haystack_units, weave
from .sample import Sample, fit, rng_for

VARIANTS = {"vt": ("noise", 1, 4), "vt_multichain": ("noise", 2, 4)}  # (haystack, chains, hops)


def variable_tracking(name: str, context_len: int, seed: int, count) -> Sample:
    haystack, n_chains, hops = VARIANTS[name]
    rng = rng_for(name, context_len, seed)
    used: set[str] = set()

    def variable() -> str:
        while True:
            v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if v not in used:
                used.add(v)
                return v

    chains, starts = [], []
    for _ in range(n_chains):
        value = str(rng.randint(10000, 99999))
        names = [variable() for _ in range(hops + 1)]
        statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        chains.append((value, names, statements))
        starts.append(value)
    texts, depths = [], []
    for _, _, statements in chains:  # each chain in order through the text
        points = sorted(rng.random() for _ in statements)
        texts += statements
        depths += points
    value, names, _ = chains[0]
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f" Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
        f"are assigned the value {value}, they are:"
    )
    units = haystack_units(haystack, rng)

    def build(n: int) -> str:
        return header + weave(units[:n], texts, depths)

    n = fit(build, len(units), context_len - count(question + prefix) - 2, count)
    return Sample(
        name,
        build(n),
        question,
        prefix,
        names,
        "all",
        max_new_tokens=30,
        meta={"haystack": haystack, "chains": [c[1] for c in chains], "values": starts, "units": n},
    )
