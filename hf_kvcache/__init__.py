"""hf-kvcache: KV-cache compression for Hugging Face Transformers.

`import hf_kvcache` registers our cache names, so `model.generate(cache_implementation="sink",
cache_config={"sinks": 4, "window": 508})` works, as does `model.generate(cache=SinkCache(model, ...))`
(`past_key_values=` before transformers 5.24; `hf_kvcache.cache_kwargs(cache)` gives the installed version's name).
The transformers versions supported and every internal relied on: hf_kvcache.integration.

Packages by role (docs/design.md draws them with their allowed imports, checked by import-linter in the tests): `caches`
(the public classes and their catalog), `attention` (the bridge), `layers` (the per-layer core), `policies` / `stores`
(which tokens stay / at what precision), `kernels` (attention from codes), `common` (RoPE, rotations, validation,
architecture facts), `integration` (the transformers boundary), `sharing` (configs, Hub export, state files,
calibration, the offline model and corpus), `paged` (quantized pages for continuous batching), `evaluation` (the
harness, above all of these: nothing of the core imports it), `cli` (the `hf-kvcache` command). `install` wires them
into transformers at import.
"""

from .attention import enable
from .caches import (
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_CONFIGS,
    CompositeCache,
    ExpectedAttentionCache,
    FullCache,
    H2OCache,
    KeyDiffCache,
    KIVICache,
    KnormCache,
    KVCache,
    KVzapCache,
    KVzipCache,
    QuantizedFP8Cache,
    RandomEvictionCache,
    SinkCache,
    SlidingWindowCache,
    SnapKVCache,
    TOVACache,
    build_cache,
    default_cache_config,
)
from .install import register, register_at_import
from .integration import CACHE_ARG, UnsupportedTransformersError, cache_kwargs, returned_cache
from .paged import enable_paged
from .paged import install as _install_paged
from .sharing.hub import KVCacheConfig, load_cache_config, publish, save_cache_config
from .sharing.state import load_cache_state, read_cache_state_header, save_cache_state
from .version import __version__  # noqa: F401  (hf_kvcache.__version__)

register_at_import()
# continuous batching reads `kv_cache_dtype` (hf_kvcache.paged, docs/serving.md); where transformers' internals changed
# this leaves it untouched and a run asking for quantized pages raises (hf_kvcache.install.before_continuous_batching)
_install_paged(strict=False)

__all__ = [
    "CACHE_ARG",
    "CACHE_IMPLEMENTATIONS",
    "CompositeCache",
    "DEFAULT_CACHE_CONFIGS",
    "ExpectedAttentionCache",
    "FullCache",
    "H2OCache",
    "KVCache",
    "KVzapCache",
    "KVzipCache",
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
