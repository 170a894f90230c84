"""hf-kvcache: KV-cache compression for Hugging Face Transformers.

`import hf_kvcache` registers our cache names, so `model.generate(cache_implementation="sink",
cache_config={"sinks": 4, "window": 508})` works, as does `model.generate(past_key_values=SinkCache(model, ...))`.
"""

from .attention import enable
from .caches import FullCache, H2OCache, KVCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .composite import CompositeCache
from .quantized import KIVICache, QuantizedFP8Cache
from .registry import (
    CACHE_IMPLEMENTATIONS,
    build_cache,
    load_cache_config,
    register,
    save_cache_config,
)

__version__ = "0.1.0"

register()

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "CompositeCache",
    "FullCache",
    "H2OCache",
    "KVCache",
    "KIVICache",
    "QuantizedFP8Cache",
    "RandomEvictionCache",
    "SinkCache",
    "SlidingWindowCache",
    "build_cache",
    "enable",
    "load_cache_config",
    "register",
    "save_cache_config",
]
