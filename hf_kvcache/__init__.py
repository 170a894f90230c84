"""hf-kvcache: KV-cache compression for Hugging Face Transformers.

`import hf_kvcache` registers our cache names, so `model.generate(cache_implementation="sink",
cache_config={"sinks": 4, "window": 508})` works, as does `model.generate(cache=SinkCache(model, ...))`
(`past_key_values=` before transformers 5.24; `hf_kvcache.cache_kwargs(cache)` gives the installed version's name).
The transformers versions supported and every internal relied on: hf_kvcache.integration.
"""

from .attention import enable
from .caches import FullCache, H2OCache, KVCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .composite import CompositeCache
from .integration import CACHE_ARG, UnsupportedTransformersError, cache_kwargs, returned_cache
from .quantized import KIVICache, QuantizedFP8Cache
from .registry import (
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_CONFIGS,
    build_cache,
    default_cache_config,
    load_cache_config,
    register,
    register_at_import,
    save_cache_config,
)
from .scorer_caches import ExpectedAttentionCache, KeyDiffCache, KnormCache, SnapKVCache, TOVACache

__version__ = "0.2.0"

register_at_import()

from .hub import KVCacheConfig, publish  # noqa: E402  (needs the registry filled)
from .paged import enable_paged, install as _install_paged  # noqa: E402

# continuous batching reads `kv_cache_dtype` (hf_kvcache.paged, docs/serving.md); where transformers' internals changed
# this leaves it untouched and a run asking for quantized pages raises (hf_kvcache.registry.before_continuous_batching)
_install_paged(strict=False)
from .state import load_cache_state, read_cache_state_header, save_cache_state  # noqa: E402

__all__ = [
    "CACHE_ARG",
    "CACHE_IMPLEMENTATIONS",
    "CompositeCache",
    "DEFAULT_CACHE_CONFIGS",
    "ExpectedAttentionCache",
    "FullCache",
    "H2OCache",
    "KVCache",
    "KIVICache",
    "KVCacheConfig",
    "KeyDiffCache",
    "KnormCache",
    "QuantizedFP8Cache",
    "RandomEvictionCache",
    "SinkCache",
    "SlidingWindowCache",
    "SnapKVCache",
    "TOVACache",
    "UnsupportedTransformersError",
    "build_cache",
    "cache_kwargs",
    "default_cache_config",
    "enable",
    "enable_paged",
    "load_cache_config",
    "load_cache_state",
    "publish",
    "read_cache_state_header",
    "register",
    "returned_cache",
    "save_cache_config",
    "save_cache_state",
]
