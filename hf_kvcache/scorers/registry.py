"""The scorers by name: what `"scorer": NAME` in a composite's heavy region, the scorer caches and the tests read.

Adding a scorer: its module in this package (a `Scorer` dataclass) and one line here. The line makes it
- a heavy-region scorer of CompositeCache (`{"role": "heavy", "scorer": NAME, ...}`, its fields as options);
- a cache of its own, `cache_implementation=NAME`: its hand-written class, else the plain
  hf_kvcache.caches.scorers.ScorerCache driving it (`ScorerCache.of`, put in the catalog by
  hf_kvcache.caches.registry), with its defaults, bad-input rows and support-matrix row;
- a row of the scorer table in docs/scorers.md and a case of the scorer tests (tests/test_scorer_registry.py).
"""

from __future__ import annotations

import dataclasses

from .base import Scorer
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import Knorm
from .kvzap import KVzap
from .kvzip import KVzip
from .lagkv import LagKV
from .random_keys import RandomKeys
from .snapkv import SnapKV
from .tova import TOVA

#: name -> scorer class (the name is also `cls.name`)
SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls for cls in (H2O, TOVA, Knorm, KeyDiff, SnapKV, ExpectedAttention, RandomKeys, LagKV, KVzip, KVzap)
}

#: scorers only their own cache can drive: it runs model forwards (KVzip's reconstruction) or hooks the attention
#: inputs (KVzap's surrogate)
CACHE_DRIVEN = tuple(n for n, cls in SCORERS.items() if cls.needs_model_forwards or cls.needs_attention_inputs)

#: what may rank a composite's heavy hitters: every scorer that its own cache does not have to drive
HEAVY_SCORERS = tuple(name for name in SCORERS if name not in CACHE_DRIVEN)


def options_of(name: str) -> tuple[str, ...]:
    """The parameters a config may give scorer `name` (its dataclass fields that `__init__` takes, but those set
    from the model)."""
    return tuple(f.name for f in dataclasses.fields(SCORERS[name]) if f.init and not f.metadata.get("bound"))


def make_scorer(name: str, **options) -> Scorer:
    """The scorer called `name` with `options` (its dataclass fields; each validated by the scorer)."""
    if name not in SCORERS:
        raise ValueError(f"Unknown scorer {name!r}; allowed values: {', '.join(SCORERS)}.")
    return SCORERS[name](**options)
