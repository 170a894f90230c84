"""hf-kvcache: KV-cache compression for Hugging Face Transformers.

`import hf_kvcache` registers our cache names, so `model.generate(cache_implementation="sink",
cache_config={"sinks": 4, "window": 508})` works, as does `model.generate(past_key_values=SinkCache(model, ...))`.
"""

from .attention import enable
from .caches import FullCache, H2OCache, KVCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .composite import CompositeCache
from .quantized import KIVICache, QuantizedFP8Cache
from .scorer_caches import ExpectedAttentionCache, KeyDiffCache, KnormCache, SnapKVCache, TOVACache
from .registry import (
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_CONFIGS,
    build_cache,
    default_cache_config,
    load_cache_config,
    register,
    save_cache_config,
)

__version__ = "0.1.0"

register()

from .hub import KVCacheConfig, publish  # noqa: E402  (needs the registry filled)
from .paged import enable_paged, install as _install_paged  # noqa: E402

_install_paged(strict=False)  # continuous batching reads `kv_cache_dtype` (hf_kvcache.paged, docs/serving.md)
from .state import load_cache_state, read_cache_state_header, save_cache_state  # noqa: E402

__all__ = [
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
    "build_cache",
    "default_cache_config",
    "enable",
    "enable_paged",
    "load_cache_config",
    "load_cache_state",
    "publish",
    "read_cache_state_header",
    "register",
    "save_cache_config",
    "save_cache_state",
]
