"""Registration of our cache names with `generate(cache_implementation=..., cache_config=...)`.

transformers 5.x validates `cache_implementation` against a fixed tuple and hard-codes the name-to-class mapping in
`GenerationMixin._prepare_cache_for_generation`; hf_kvcache.integration.generation extends both (idempotently, each
step behind a contract) and calls hf_kvcache.install's `build_for_generate`, which builds from this catalog.
`GenerationMixin.init_continuous_batching` is extended
too: it hands a model our caches switched to the attention bridge back to its own attention implementation (the
only kind continuous batching accepts) and checks that quantized pages asked for can be honoured.

Published configs. A model's `generation_config.json` may carry `"hf_kvcache": {"cache": NAME, "config": {...},
"version": 1}` (see hf_kvcache.sharing.hub): transformers keeps that key and ignores it, so the model loads and
generates
everywhere; with hf_kvcache imported, `generate` builds that cache whenever the call sets no `cache_implementation`
and passes no `cache` (either of which wins). `save_cache_config` writes that safe form, never a
`cache_implementation` (which makes `from_pretrained` fail wherever hf_kvcache is not imported).

Defaults. Every name runs without a `cache_config`: the caller's keys are merged over `DEFAULT_CACHE_CONFIGS`, with
token sizes capped by the model's `max_position_embeddings` (L below; 1024 when the config has none):

| name | defaults | with L < 1024 |
|---|---|---|
| `sink` | sinks 4 + window 1020 (StreamingLLM) | sinks min(4, L-1), window L - sinks |
| `sliding` | window 1024 | window L |
| `h2o` | heavy 0.1 + recent 0.1 of the prompt (H2O's 20% budget) | same |
| `random_eviction` | heavy 0.1 + recent 0.1 of the prompt | same |
| `composite` | preset "sinks_heavy_recent", budget 1024 (4 sinks, recent + heavy hitters in FP8 E4M3) | budget max(L,
6) |
| `fp8` | the class defaults: E4M3, per-token scales, Hadamard-rotated keys, no full-precision window | same |
| `kivi` | the class defaults: int4, group 32, residual 128, quanto (else hqq); value groups gcd(32, head_dim) when
head_dim is not a multiple of 32 | same |
| `knorm` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.caches.scorers) | same |
| `keydiff` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.caches.scorers) | same |
| `tova` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.caches.scorers) | same |
| `snapkv` | budget 1024 tokens (a prompt ratio can fall below its 64-token window); window 64, kernel 5 | same |
| `expected_attention` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.caches.scorers) | same |
| `kvzip` | budget 0.2 of the prompt, allotted model-wide (layer- and head-adaptive, floor 0.2); 4 sinks, chunks of
2048, the model's own tokenizer (hf_kvcache.caches.kvzip) |
same |
| `kvzap` | budget 0.2 of the prompt, allotted model-wide as kvzip's; the surrogate shipped for the model (SmolLM2-135M
only; others: `surrogate`) (hf_kvcache.caches.kvzap) | same |
| `lagkv` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.scorers.lagkv) | same |

A scorer added to hf_kvcache.scorers.registry without a cache of its own (`ScorerCache.of`): budget 0.2 of the
prompt and the scorer's own defaults, as `lagkv` (docs/caches.md has a section for each, from the registry).

A caller's size key replaces the default sizes it conflicts with: `budget` replaces sink's window and h2o's
heavy/recent; `regions` replaces composite's preset and budget; any other key just overrides its default.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..common.architecture import compressed_layer_config
from ..integration import generation as upstream_generation
from ..integration.versions import (  # noqa: F401  (re-exported: the tested range is part of the catalog's contract)
    SUPPORTED_RANGE_TEXT,
    SUPPORTED_TRANSFORMERS,
    check_transformers_version,
)
from ..scorers.registry import SCORERS
from .base import KVCache
from .catalog import CACHE_IMPLEMENTATIONS
from .composite import CompositeCache
from .eviction import H2OCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .kvzap import KVzapCache
from .kvzip import KVzipCache
from .quantized import KIVICache, QuantizedFP8Cache
from .scorers import SCORER_CACHES, ScorerCache

#: cache_implementation name -> class (the dict lives in hf_kvcache.caches.catalog, which the base class reads)
CACHE_IMPLEMENTATIONS.update(
    {
        SinkCache.cache_name: SinkCache,
        SlidingWindowCache.cache_name: SlidingWindowCache,
        H2OCache.cache_name: H2OCache,
        CompositeCache.cache_name: CompositeCache,
        RandomEvictionCache.cache_name: RandomEvictionCache,
        QuantizedFP8Cache.cache_name: QuantizedFP8Cache,
        KIVICache.cache_name: KIVICache,
        **{cls.cache_name: cls for cls in SCORER_CACHES},
        KVzipCache.cache_name: KVzipCache,
        KVzapCache.cache_name: KVzapCache,
    }
)
# every other registered scorer: the plain scorer cache driving it (the registry's line is all a scorer needs)
CACHE_IMPLEMENTATIONS.update(
    {name: ScorerCache.of(scorer) for name, scorer in SCORERS.items() if name not in CACHE_IMPLEMENTATIONS}
)

CONFIG_FILE = "kvcache_config.json"

#: defaults merged under a caller's cache_config (token sizes for a model with >= 1024 positions; see the module
#: docstring and `default_cache_config` for the cap by max_position_embeddings)
DEFAULT_CACHE_CONFIGS: dict[str, dict[str, Any]] = {
    "sink": {"sinks": 4, "window": 1020},
    "sliding": {"window": 1024},
    "h2o": {"heavy": 0.1, "recent": 0.1},
    "random_eviction": {"heavy": 0.1, "recent": 0.1},
    "composite": {"preset": "sinks_heavy_recent", "budget": 1024},
    "fp8": {},
    "kivi": {},
    **{cls.cache_name: {"budget": 0.2} for cls in SCORER_CACHES},
    **{name: {"budget": 0.2} for name, cls in CACHE_IMPLEMENTATIONS.items() if issubclass(cls, ScorerCache)},
    "snapkv": {"budget": 1024},  # a ratio of a short prompt can be smaller than its 64-token observation window
    "kvzip": {"budget": 0.2},
    "kvzap": {"budget": 0.2},
}

#: a caller's key -> the default keys it replaces (besides itself)
DEFAULT_REPLACED_BY: dict[str, dict[str, tuple[str, ...]]] = {
    "sink": {"budget": ("window",)},
    "h2o": {"budget": ("heavy", "recent")},
    "random_eviction": {"budget": ("heavy", "recent")},
    "composite": {"regions": ("preset", "budget")},
    "kivi": {"group_size": ("value_group_size",)},
}


def builtin_cache_implementations() -> tuple[str, ...]:
    """The names transformers itself accepts (ours excluded)."""
    return upstream_generation.builtin_cache_names()


def _max_positions(config_or_model) -> int | None:
    config = getattr(config_or_model, "config", config_or_model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def default_cache_config(name: str, config_or_model=None) -> dict[str, Any]:
    """The documented defaults for cache `name` (a copy), token sizes capped by the model's max_position_embeddings.
    Names without an entry (custom registered caches) have no defaults."""
    defaults = json.loads(json.dumps(DEFAULT_CACHE_CONFIGS.get(name, {})))
    if name == "kivi" and config_or_model is not None:
        head_dim = _head_dim(config_or_model)
        if head_dim and head_dim % 32:  # per-token value groups must divide head_dim (key blocks stay 32 tokens)
            defaults["value_group_size"] = math.gcd(32, head_dim)
    limit = _max_positions(config_or_model) if config_or_model is not None else None
    if limit is None or limit >= 1024:
        return defaults
    if name == "sink":
        defaults["sinks"] = min(defaults["sinks"], limit - 1)
        defaults["window"] = limit - defaults["sinks"]
    elif name == "sliding":
        defaults["window"] = limit
    elif name == "composite":
        defaults["budget"] = max(limit, 6)  # the preset's 4 sinks + at least one recent and one heavy slot
    return defaults


def _head_dim(config_or_model) -> int | None:
    config = getattr(config_or_model, "config", config_or_model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    config = compressed_layer_config(config)  # (Gemma 4: the compressed layers' own head_dim)
    head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int):
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    return head_dim


def resolve_cache_config(name: str, config_or_model, cache_config: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's `cache_config` merged over the defaults for `name` (the caller's dict is not modified)."""
    given = dict(cache_config or {})
    defaults = default_cache_config(name, config_or_model)
    for key in given:
        for replaced in DEFAULT_REPLACED_BY.get(name, {}).get(key, ()):
            defaults.pop(replaced, None)
    return {**defaults, **given}


def build_cache(name: str, config_or_model, cache_config: dict[str, Any] | None = None) -> KVCache:
    """Build a registered cache by name, e.g. from a published config; the caller's settings are merged over the
    defaults (`DEFAULT_CACHE_CONFIGS`, derived from the model)."""
    if name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"Unknown cache {name!r}; hf_kvcache caches are {sorted(CACHE_IMPLEMENTATIONS)}.")
    if cache_config is not None and not isinstance(cache_config, dict):
        raise ValueError(f"cache_config for {name!r} must be a dict of settings, got {type(cache_config).__name__}.")
    return CACHE_IMPLEMENTATIONS[name].from_cache_config(
        config_or_model, resolve_cache_config(name, config_or_model, cache_config)
    )


def _validation_config():
    """A minimal Llama-shaped config: building a cache against it checks every parameter value (no tensors are
    allocated before the first update)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
