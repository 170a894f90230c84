"""Installs hf_kvcache into transformers: `import hf_kvcache` runs `register_at_import()`.

- our cache names for `generate(cache_implementation=NAME, cache_config={...})`, built from the catalog
  (hf_kvcache.caches.registry), and a cache published in a model's generation_config (hf_kvcache.sharing.hub);
- a cache object of ours passed to `generate` switches the model to the attention bridge (hf_kvcache.attention);
- continuous batching: a model switched to the bridge goes back to its own attention first, and quantized pages
  asked for are checked (hf_kvcache.paged).
Every transformers internal touched here goes through hf_kvcache.integration; every attribute of transformers
replaced is one of hf_kvcache.integration.patches, applied by its `install` (groups `cache_names`, `generate` here).
"""

from __future__ import annotations

import warnings

from .caches.base import KVCache
from .caches.registry import CACHE_IMPLEMENTATIONS, build_cache
from .integration import generation as upstream_generation
from .integration import patches
from .integration.cache_argument import CACHE_ARG
from .integration.contracts import require
from .integration.versions import UnsupportedTransformersError, warn_if_untested


def _published_cache(request: upstream_generation.CacheRequest):
    """(name, settings) from generation_config.hf_kvcache when this call should use it, else None."""
    generation_config = request.generation_config
    if generation_config.cache_implementation is not None or request.given is not None:
        return None
    if generation_config.use_cache is False or not request.supports_default_cache():
        return None
    from .sharing.hub import KVCacheConfig

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
        from .attention.bridge import enable

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
    if name is not None and not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise ValueError(f"`cls` must be a subclass of hf_kvcache.KVCache, got {cls!r}.")
    # refuses a name of transformers' own before anything is registered (so a refused name never stays in ours)
    upstream_generation.add_cache_names(tuple(CACHE_IMPLEMENTATIONS) + ((name,) if name is not None else ()))
    if name is not None:
        CACHE_IMPLEMENTATIONS[name] = cls
    upstream_generation.set_generate_hooks(build_for_generate, prepared_for_generate, before_continuous_batching)
    patches.install(patches.CACHE_NAMES, patches.GENERATE)
    from .attention.bridge import register_attention_functions

    register_attention_functions()


def register_at_import() -> bool:
    """`register()` as `import hf_kvcache` runs it: where a contract it needs does not hold, the package still
    imports (cache objects passed to `generate` need only the attention bridge's contracts) and one warning names
    the internal; `cache_implementation=` with our names is then unavailable. False in that case."""
    try:
        register()
    except UnsupportedTransformersError as error:
        warnings.warn(
            f"{error} `generate(cache_implementation=...)` with hf_kvcache names is unavailable; cache "
            "objects still work where the bridge's contracts hold.",
            stacklevel=3,
        )
        return False
    return True


def before_continuous_batching(model, args, kwargs) -> None:
    """transformers' continuous batching (`generate_batch`, `init_continuous_batching`) on a model one of our caches
    switched to the attention bridge: continuous batching accepts only its own attention implementations and never
    runs our caches, so the model goes back to its own implementation first (`hf_kvcache.disable`); the next
    `generate` with one of our caches switches it again. Quantized pages asked for are checked here (raises
    `UnsupportedTransformersError` where transformers' internals changed, instead of model-dtype pages)."""
    from .attention.bridge import disable, is_enabled
    from .paged.cache import check_requested

    named = dict(zip(("generation_config", "continuous_batching_config"), args), **kwargs)
    check_requested(model, named.get("generation_config"), named.get("continuous_batching_config"))
    if is_enabled(model):
        disable(model)
