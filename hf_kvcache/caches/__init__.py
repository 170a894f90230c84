"""The public caches: presets of a policy and a store per layer (`base`: KVCache and FullCache; `eviction`: sink,
sliding window, H2O, random eviction; `composite`; `quantized`: FP8 and KIVI; `scorers`: the kvpress-style
scorers; `kvzip`: context-reconstruction scores), and the catalog of their names with the documented defaults
(`registry`).

May import: attention, layers, policies, stores, kernels, common, integration.
"""

from .base import FullCache, KVCache
from .composite import CompositeCache
from .eviction import H2OCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .kvzap import KVzapCache
from .kvzip import KVzipCache
from .quantized import KIVICache, QuantizedFP8Cache
from .registry import CACHE_IMPLEMENTATIONS, DEFAULT_CACHE_CONFIGS, build_cache, default_cache_config
from .scorers import ExpectedAttentionCache, KeyDiffCache, KnormCache, SnapKVCache, TOVACache

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "CompositeCache",
    "DEFAULT_CACHE_CONFIGS",
    "ExpectedAttentionCache",
    "FullCache",
    "H2OCache",
    "KIVICache",
    "KVCache",
    "KVzapCache",
    "KVzipCache",
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
]
