"""Registration of our cache names with `generate(cache_implementation=..., cache_config=...)`.

transformers 5.x validates `cache_implementation` against a fixed tuple and hard-codes the name-to-class mapping in
`GenerationMixin._prepare_cache_for_generation`; hf_kvcache.integration.generation extends both (idempotently, each
step behind a contract) and calls `build_for_generate` here. `GenerationMixin.init_continuous_batching` is extended
too: it hands a model our caches switched to the attention bridge back to its own attention implementation (the
only kind continuous batching accepts) and checks that quantized pages asked for can be honoured.

Published configs. A model's `generation_config.json` may carry `"hf_kvcache": {"cache": NAME, "config": {...},
"version": 1}` (see hf_kvcache.hub): transformers keeps that key and ignores it, so the model loads and generates
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
| `composite` | preset "sinks_heavy_recent", budget 1024 (4 sinks, recent + heavy hitters in FP8 E4M3) | budget max(L, 6) |
| `fp8` | the class defaults: E4M3, per-token scales, Hadamard-rotated keys, no full-precision window | same |
| `kivi` | the class defaults: int4, group 32, residual 128, quanto (else hqq); value groups gcd(32, head_dim) when head_dim is not a multiple of 32 | same |
| `knorm` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.scorer_caches) | same |
| `keydiff` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.scorer_caches) | same |
| `tova` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.scorer_caches) | same |
| `snapkv` | budget 1024 tokens (a prompt ratio can fall below its 64-token window); window 64, kernel 5 | same |
| `expected_attention` | budget 0.2 of the prompt; the scorer's own defaults (hf_kvcache.scorer_caches) | same |

A caller's size key replaces the default sizes it conflicts with: `budget` replaces sink's window and h2o's
heavy/recent; `regions` replaces composite's preset and budget; any other key just overrides its default.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

from .caches import H2OCache, KVCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .composite import CompositeCache
from .integration import generation as upstream_generation
from .integration.cache_argument import CACHE_ARG
from .integration.contracts import require
from .integration.versions import (  # noqa: F401  (re-exported: the range is part of the registry's contract)
    SUPPORTED_RANGE_TEXT,
    SUPPORTED_TRANSFORMERS,
    UnsupportedTransformersError,
    check_transformers_version,
    warn_if_untested,
)
from .quantized import KIVICache, QuantizedFP8Cache
from .scorer_caches import SCORER_CACHES

#: cache_implementation name -> class
CACHE_IMPLEMENTATIONS: dict[str, type[KVCache]] = {
    SinkCache.cache_name: SinkCache,
    SlidingWindowCache.cache_name: SlidingWindowCache,
    H2OCache.cache_name: H2OCache,
    CompositeCache.cache_name: CompositeCache,
    RandomEvictionCache.cache_name: RandomEvictionCache,
    QuantizedFP8Cache.cache_name: QuantizedFP8Cache,
    KIVICache.cache_name: KIVICache,
    **{cls.cache_name: cls for cls in SCORER_CACHES},
}

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
    "snapkv": {"budget": 1024},  # a ratio of a short prompt can be smaller than its 64-token observation window
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


def _published_cache(request: upstream_generation.CacheRequest):
    """(name, settings) from generation_config.hf_kvcache when this call should use it, else None."""
    generation_config = request.generation_config
    if generation_config.cache_implementation is not None or request.given is not None:
        return None
    if generation_config.use_cache is False or not request.supports_default_cache():
        return None
    from .hub import KVCacheConfig

    published = KVCacheConfig.from_generation_config(generation_config, validate=False)
    if published is None:
        return None
    if request.model.config.is_encoder_decoder:
        raise ValueError(
            f"generation_config key 'hf_kvcache' names cache {published.cache!r}, but hf_kvcache caches are for "
            f"decoder-only models; remove the key or pass cache_implementation='dynamic'."
        )
    return published.cache, published.config


def build_for_generate(request: upstream_generation.CacheRequest) -> KVCache | None:
    """The cache `generate` should use when it names one of ours (or the model's generation config publishes one);
    None leaves the call to transformers' own cache preparation."""
    generation_config = request.generation_config
    name, cache_config = generation_config.cache_implementation, generation_config.cache_config
    published = _published_cache(request)
    if published is not None:
        name, cache_config = published
    if name not in CACHE_IMPLEMENTATIONS:
        return None
    if request.is_assistant and isinstance(request.given, KVCache):
        # Assisted generation (<= 5.23) hands the main model's generation config (our cache name included) to the
        # assistant, and the assistant's cache of the previous round back with it: keep using that cache.
        return request.given
    if request.given is not None:
        raise ValueError(
            f"Passing both `cache_implementation` (used to initialize certain caches) and `{CACHE_ARG}` (a "
            "Cache object) is unsupported. Please use only one of the two."
        )
    if generation_config.use_cache is False:
        return None
    try:
        cache = build_cache(name, request.model, cache_config)
    except ValueError as error:
        if published is None:
            raise
        raise ValueError(
            f"generation_config.json key 'hf_kvcache' (cache {name!r}) does not build for this model: {error} "
            f"Pass cache_implementation='dynamic' (or another cache) to generate without it."
        ) from None
    _check_generation(request, cache)
    return cache


def prepared_for_generate(request: upstream_generation.CacheRequest) -> None:
    """After transformers prepared the cache: one of ours passed by the caller switches the model to the bridge."""
    if isinstance(request.given, KVCache):
        from .attention import enable

        enable(request.model)
        _check_generation(request, request.given)


def _check_generation(request: upstream_generation.CacheRequest, cache: KVCache) -> None:
    _refuse_rollback_past_budget(cache, request)
    if cache.is_compileable and request.generation_config.compile_config is not None:
        require(upstream_generation.AUTO_COMPILE)  # compilation was asked for: never silently eager


def _refuse_rollback_past_budget(cache, request: upstream_generation.CacheRequest) -> None:
    """Assisted generation and prompt lookup roll rejected candidate tokens back with `cache.crop`, which a cache can
    do only until it first evicts (evicted tokens cannot come back): refuse, before any forward, a generation whose
    length is past a layer's budget. The verifying forward may hold `max_length + 1` tokens (prompt lookup proposes
    up to the last position, plus the token being verified; `max_cache_length` is `max_length - 1`)."""
    if not request.assisted or request.max_cache_length is None:
        return
    needed = request.max_cache_length + 2
    for layer in cache.compressed_layers:
        if layer.policy.has_evicted(needed):
            raise ValueError(
                f"{type(cache).__name__} cannot serve assisted generation / prompt lookup (`assistant_model`, "
                f"`prompt_lookup_num_tokens`): rejected candidates are rolled back with `crop`, which is impossible "
                f"once tokens were evicted, and layer {layer.layer_idx} keeps {layer.policy.capacity} tokens of the "
                f"up to {needed} this generation holds (prompt + max_new_tokens + 1). Give a budget of at least "
                f"{needed}, a cache that keeps every token (fp8, kivi), or generate without an assistant."
            )


def register(name: str | None = None, cls: type[KVCache] | None = None) -> None:
    """Register all our caches (idempotent); with `name` and `cls`, add one more cache class first. On a
    transformers outside the tested range this warns once; a contract that does not hold raises
    `UnsupportedTransformersError` naming it."""
    warn_if_untested()
    names = set(CACHE_IMPLEMENTATIONS)
    if name is not None:
        if not (isinstance(cls, type) and issubclass(cls, KVCache)):
            raise ValueError(f"`cls` must be a subclass of hf_kvcache.KVCache, got {cls!r}.")
        names.add(name)
    clash = names & set(upstream_generation.builtin_cache_names())
    if clash:
        raise RuntimeError(f"hf_kvcache cache names {sorted(clash)} would shadow transformers' own cache names.")
    if name is not None:
        CACHE_IMPLEMENTATIONS[name] = cls
    upstream_generation.add_cache_names(tuple(CACHE_IMPLEMENTATIONS))
    upstream_generation.install_generate_hooks(build_for_generate, prepared_for_generate, before_continuous_batching)
    from .attention import register_attention_functions

    register_attention_functions()


def register_at_import() -> bool:
    """`register()` as `import hf_kvcache` runs it: where a contract it needs does not hold, the package still
    imports (cache objects passed to `generate` need only the attention bridge's contracts) and one warning names
    the internal; `cache_implementation=` with our names is then unavailable. False in that case."""
    try:
        register()
    except UnsupportedTransformersError as error:
        warnings.warn(f"{error} `generate(cache_implementation=...)` with hf_kvcache names is unavailable; cache "
                      "objects still work where the bridge's contracts hold.", stacklevel=3)
        return False
    return True


def before_continuous_batching(model, args, kwargs) -> None:
    """transformers' continuous batching (`generate_batch`, `init_continuous_batching`) on a model one of our caches
    switched to the attention bridge: continuous batching accepts only its own attention implementations and never
    runs our caches, so the model goes back to its own implementation first (`hf_kvcache.disable`); the next
    `generate` with one of our caches switches it again. Quantized pages asked for are checked here (raises
    `UnsupportedTransformersError` where transformers' internals changed, instead of model-dtype pages)."""
    from .attention import disable, is_enabled
    from .paged.cache import check_requested

    named = dict(zip(("generation_config", "continuous_batching_config"), args), **kwargs)
    check_requested(model, named.get("generation_config"), named.get("continuous_batching_config"))
    if is_enabled(model):
        disable(model)


def build_cache(name: str, config_or_model, cache_config: dict[str, Any] | None = None) -> KVCache:
    """Build a registered cache by name, e.g. from a published config; the caller's settings are merged over the
    defaults (`DEFAULT_CACHE_CONFIGS`, derived from the model)."""
    if name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"Unknown cache {name!r}; hf_kvcache caches are {sorted(CACHE_IMPLEMENTATIONS)}.")
    if cache_config is not None and not isinstance(cache_config, dict):
        raise ValueError(f"cache_config for {name!r} must be a dict of settings, got {type(cache_config).__name__}.")
    return CACHE_IMPLEMENTATIONS[name].from_cache_config(config_or_model, resolve_cache_config(
        name, config_or_model, cache_config))


def _validation_config():
    """A minimal Llama-shaped config: building a cache against it checks every parameter value (no tensors are
    allocated before the first update)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)


def save_cache_config(directory: str | os.PathLike, name: str, cache_config: dict[str, Any] | None = None,
                      model_config=None) -> str:
    """Write `kvcache_config.json` ({"cache": name, "config": {...}, "version": 1}) into `directory`, after checking
    that the settings are plain JSON and build a cache (against `model_config` when given, else a minimal
    Llama-shaped config). Never writes a `cache_implementation` (see hf_kvcache.hub); to make `generate` on the
    saved model use the cache, use `hf_kvcache.hub.publish(directory, name, cache_config)`, which also writes the
    `hf_kvcache` key of generation_config.json."""
    from .hub import KVCacheConfig

    config = KVCacheConfig(name, cache_config, model_config=model_config, source=f"save_cache_config({name!r})")
    return config.save_pretrained(directory)


def load_cache_config(directory: str | os.PathLike) -> dict[str, Any]:
    """Read the cache config of a folder (`kvcache_config.json`, in the current or the 0.1 format, else the
    `hf_kvcache` key of generation_config.json): returns {"cache_implementation": ..., "cache_config": {...}} for
    `model.generate(**loaded)`."""
    from .hub import KVCacheConfig

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"No {CONFIG_FILE} in {directory}: not a folder.")
    return KVCacheConfig.from_pretrained(directory).generate_kwargs()
