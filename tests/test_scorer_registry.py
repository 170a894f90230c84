"""Every scorer of hf_kvcache.scorers.registry, generically: adding a scorer (its module + one registry line) adds its
cases here, its cache name, its support-matrix row (tests/test_support_matrix.py), its composite cases
(tests/test_composite.py: the heavy region keeps the standalone cache's tokens) and its row of the scorer table in
docs/scorers.md (written with HF_KVCACHE_WRITE_SCORERS=1, checked otherwise).

Checked for each scorer: its cache generates a left-padded batch in both compression modes with every row as if
alone and holds its budget; its declared state follows beam reordering, `reset` and `nbytes`; its parameters are
validated naming the field; in a composite's heavy region (FP8, with sinks) it generates and holds its region."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import PAD, build_model, left_pad, random_ids

import hf_kvcache
from hf_kvcache import CACHE_IMPLEMENTATIONS, cache_kwargs
from hf_kvcache.caches.registry import DEFAULT_CACHE_CONFIGS
from hf_kvcache.scorers import HEAVY_SCORERS, SCORERS, make_scorer
from hf_kvcache.scorers.base import STATE
from hf_kvcache.scorers.registry import CACHE_DRIVEN, options_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "scorers.md"
# scorers only their cache drives: KVzip's reconstruction forwards (tests/test_kvzip.py), KVzap's attention-input
# hooks and trained surrogate (tests/test_kvzap.py)
PLACED_BY_ITS_CACHE = CACHE_DRIVEN
CACHED = tuple(name for name in SCORERS if name not in PLACED_BY_ITS_CACHE)
PROMPTS = (12, 19, 15)


def _config(name: str, budget: int, **extra) -> dict:
    """A budget in the cache's own terms (H2O and random eviction split theirs) and the scorer's small settings."""
    sizes = {"heavy": budget // 2, "recent": budget - budget // 2} if "heavy" in DEFAULT_CACHE_CONFIGS[name] else {}
    return {**(sizes or {"budget": budget}), **SCORERS[name].small, **extra}


def test_every_scorer_is_a_cache_name_with_defaults():
    for name in SCORERS:
        assert name in CACHE_IMPLEMENTATIONS, name
        assert name in DEFAULT_CACHE_CONFIGS, name
        assert SCORERS[name].name == name
    assert set(HEAVY_SCORERS) == set(SCORERS) - set(PLACED_BY_ITS_CACHE)
    assert "lagkv" in HEAVY_SCORERS  # the scorer added by its module and one registry line (issue 47)


@pytest.mark.parametrize("compress", ["always", "prompt"])
@pytest.mark.parametrize("name", CACHED)
def test_left_padded_batch_generates_each_row_as_alone(name, compress):
    model = build_model("llama")
    rows = [random_ids(1, n, seed=40 + n)[0] for n in PROMPTS]
    ids, mask = left_pad(rows)
    config = _config(name, 8, compress=compress)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, cache_implementation=name, cache_config=config)
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    full = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    assert not torch.equal(batched, full[:, ids.shape[1] :])  # the budget of 8 really evicts
    if not SCORERS[name].row_independent:  # (random eviction: draws keyed by batch row and stream index)
        return
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), f"row {i}"


@pytest.mark.parametrize("name", CACHED)
def test_the_cache_holds_its_budget(name):
    model = build_model("llama")
    cache = CACHE_IMPLEMENTATIONS[name](model, **_config(name, 8))
    model.generate(random_ids(2, 20), max_new_tokens=6, do_sample=False, **cache_kwargs(cache))
    for layer in cache.compressed_layers:
        assert int(layer.slot_valid[..., :-1].sum(-1).max()) <= 8


def _state_fields(scorer):
    return [f for f in dataclasses.fields(scorer) if STATE in f.metadata]


@pytest.mark.parametrize("name", CACHED)
def test_declared_state_follows_the_batch_and_resets(name):
    """The state a scorer declares is what map_batch reorders, reset clears and nbytes counts."""
    model = build_model("llama")
    cache = CACHE_IMPLEMENTATIONS[name](model, **_config(name, 8))
    ids = random_ids(2, 20)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
        for step in range(3):
            model(input_ids=ids[:, step : step + 1], **cache_kwargs(cache))
    policy = cache.layers[0].policy
    scorer = policy.scorer
    tensors = {
        f.name: getattr(scorer, f.name)
        for f in _state_fields(scorer)
        if isinstance(getattr(scorer, f.name), torch.Tensor)
    }
    assert scorer.nbytes() == sum(t.nbytes for t in tensors.values())
    assert policy.nbytes() >= scorer.nbytes() + policy.scores.nbytes
    cache.reorder_cache(torch.tensor([1, 1]))  # beam search: both rows become row 1
    for field_name, before in tensors.items():
        after = getattr(scorer, field_name)
        assert after.shape == before.shape, field_name
        torch.testing.assert_close(after[0], before[1])
    scorer.reset()
    assert scorer.nbytes() == 0
    assert all(getattr(scorer, f.name) == f.default for f in _state_fields(scorer))


def _bad_values(field: dataclasses.Field):
    """Values a parameter must refuse, by the type of its default."""
    if isinstance(field.default, bool):
        return ["yes"]
    if isinstance(field.default, int):
        return [-1, 1.5]
    if isinstance(field.default, str):
        return ["no-such-value"]
    return []


@pytest.mark.parametrize("name", SCORERS)
def test_bad_parameters_name_the_field(name):
    fields = [f for f in dataclasses.fields(SCORERS[name]) if f.name in options_of(name)]
    for field in fields:
        for value in _bad_values(field):
            with pytest.raises(ValueError, match=re.escape(f"`{field.name}`")):
                make_scorer(name, **{field.name: value})
    with pytest.raises(ValueError, match=r"Unknown scorer 'pyramidkv'; allowed values: h2o, "):
        make_scorer("pyramidkv")


@pytest.mark.parametrize("name", HEAVY_SCORERS)
def test_in_a_composite_heavy_region_with_fp8_and_sinks(name):
    model = build_model("llama")
    regions = [
        {"role": "sinks", "tokens": 2},
        {"role": "window", "start": 0, "end": 4, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {"role": "heavy", "tokens": 6, "keys": "fp8_e4m3", "values": "fp8_e4m3", "scorer": name, **SCORERS[name].small},
    ]
    rows = [random_ids(1, n, seed=60 + n)[0] for n in PROMPTS]
    ids, mask = left_pad(rows)
    cache = hf_kvcache.CompositeCache(model, regions=regions)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD, **cache_kwargs(cache)
    )
    assert out.shape == (3, ids.shape[1] + 8)
    for layer in cache.compressed_layers:
        assert isinstance(layer.policy.scorer, SCORERS[name])
        assert int(layer.slot_valid[..., :-1].sum(-1).max()) <= 2 + 4 + 6


def _decode_rule(cls) -> str:
    if cls.needs_model_forwards:
        return "prompt mode only"
    if cls.rescores:
        return "re-scored before each selection (`rescore_every`)"
    if cls.needs_attention:
        return "from each step's attention"
    return "fixed at arrival"


def scorer_table() -> str:
    """The docs' scorer table, from the registry: each scorer's module docstring's first sentence, what it reads,
    how decode keeps its scores current, and where it can be used."""
    import sys

    lines = ["| name | score | reads | decode | where |", "|---|---|---|---|---|"]
    for name, cls in SCORERS.items():
        summary = " ".join(sys.modules[cls.__module__].__doc__.split("\n\n")[0].split())
        where = f'`cache_implementation="{name}"`' + (", composite heavy region" if name in HEAVY_SCORERS else "")
        options = ", ".join(f"`{o}`" for o in options_of(name)) or "none"
        where += f"; scorer parameters: {options}"
        lines.append(f"| `{name}` | {summary} | {cls.reads} | {_decode_rule(cls)} | {where} |")
    return "\n".join(lines)


def plain_scorer_caches() -> list:
    """The catalog's ScorerCache classes (LagKVCache, and `ScorerCache.of` any scorer added without a cache)."""
    from hf_kvcache.caches.scorers import ScorerCache

    return [cls for cls in CACHE_IMPLEMENTATIONS.values() if issubclass(cls, ScorerCache)]


def test_every_scorer_is_a_cache_by_its_name():
    """Adding a scorer to hf_kvcache.scorers.registry is enough for `cache_implementation=NAME`: its hand-written
    cache or a plain ScorerCache driving it (whose settings are the scorer's options)."""
    from hf_kvcache.caches.scorers import ScorerCache

    for name, scorer in SCORERS.items():
        cls = CACHE_IMPLEMENTATIONS[name]
        assert cls.cache_name == name
        if issubclass(cls, ScorerCache):
            assert cls.scorer_class is scorer and set(options_of(name)) <= set(cls.config_keys())


def test_a_scorer_without_a_cache_gets_a_plain_scorer_cache():
    from hf_kvcache.caches.registry import _validation_config
    from hf_kvcache.caches.scorers import LagKVCache, ScorerCache
    from hf_kvcache.scorers.lagkv import LagKV

    cls = ScorerCache.of(LagKV)  # as hf_kvcache.caches.registry does for a scorer without a cache class
    assert cls.__name__ == "LagKVCache" and cls.config_keys() == LagKVCache.config_keys()
    cache = cls(_validation_config(), budget=8, lag=4)
    assert cache._given == {"budget": 8, "lag": 4} and cache.layers[0].policy.scorer.lag == 4
    with pytest.raises(ValueError, match="`bogus` is not a parameter of cache 'lagkv'; its scorer's parameters: "):
        cls(_validation_config(), budget=8, bogus=1)


def cache_sections() -> str:
    """docs/caches.md's sections of the plain scorer caches (hf_kvcache.caches.scorers.ScorerCache, one per
    registered scorer without a hand-written cache): what the scorer keeps (its module docstring) and the
    constructor's parameters with their defaults (the common ones, then the scorer's options)."""
    import inspect
    import sys

    common = {
        "budget": "tokens kept: a count, or a ratio of the prompt in (0, 1] (name default: 0.2)",
        "recent": "newest tokens always kept (unset: none in prompt mode, half the budget in `always` mode)",
        "compress": '`"prompt"`: compress the prompt once, then append',
        "rescore_every": "decode re-scores the stored tokens every N steps",
        "head_budget": '`"adaptive"`: one pool for the layer\'s heads, split by score (AdaKV)',
        "safeguard": "with adaptive budgets: the share of the budget each head keeps at least",
    }
    sections = []
    for cache in plain_scorer_caches():
        scorer = cache.scorer_class
        doc = sys.modules[scorer.__module__].__doc__.strip().split("\n\n")
        lines = [f"## `{cache.cache_name}` — {cache.__name__}", "", "\n\n".join(doc[0:2]), ""]
        lines += ["| parameter | default | meaning |", "|---|---|---|"]
        parameters = inspect.signature(cache.__init__).parameters
        defaults = {**{key: parameters[key].default for key in cache.common_keys}, **cache.option_defaults()}
        for name, default in defaults.items():
            meaning = common.get(name, f"the scorer's `{name}` (hf_kvcache.scorers.{scorer.name})")
            lines.append(f"| `{name}` | `{default!r}` | {meaning} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


GENERATED = {
    DOC: (
        "<!-- scorer table: generated by tests/test_scorer_registry.py -->",
        "<!-- end of scorer table -->",
        scorer_table,
    ),
    DOC.with_name("caches.md"): (
        "<!-- generated scorer caches: written by tests/test_scorer_registry.py -->",
        "<!-- end of generated scorer caches -->",
        cache_sections,
    ),
}


@pytest.mark.parametrize("page", sorted(GENERATED), ids=lambda p: p.name)
def test_docs_generated_from_the_registry(page):
    begin, end, make = GENERATED[page]
    text = page.read_text()
    assert begin in text and end in text, f"{page} needs the markers {begin!r} ... {end!r}"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    want = f"{head}{begin}\n{make()}\n{end}{tail}"
    if os.environ.get("HF_KVCACHE_WRITE_SCORERS") == "1":
        page.write_text(want)
        text = page.read_text()
    assert text == want, f"{page.name}'s generated part is stale: run with HF_KVCACHE_WRITE_SCORERS=1"
