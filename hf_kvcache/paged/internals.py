"""The transformers internals the quantized paged cache relies on, checked at install (and by tests/test_paged.py).

transformers' continuous batching has no public extension point for the page format, so hf_kvcache.paged relies
on these (transformers 5.23); a future version that changes one of them gets an `UnsupportedTransformersError`
naming it at `import hf_kvcache`-time install instead of wrong pages at run time:

1. `continuous_api.ContinuousBatchingManager._create_batch_processor` builds the cache by calling the module-level
   name `continuous_api.PagedAttentionCache` (we point it at our subclass).
2. `cache.PagedAttentionCache.__init__(config, continuous_batching_config, device, distributed_helper, dtype,
   model_supports_logits_to_keep)` builds one allocator per attention type from the module-level dict
   `cache.ATTN_TYPE_TO_ALLOCATOR` ("full_attention", "sliding_attention"), called with keyword arguments
   (index, layer_indices, num_key_value_heads, config, cache_dtype, page_size, allow_block_sharing), and sizes
   sectors from `allocator.bytes_per_block`.
3. The allocators (`cache_allocators.FullAttentionCacheAllocator` / `SlidingAttentionCacheAllocator`): `__init__`
   calls `self.get_bytes_per_page(heads, head_dim, dtype, page_size)`; `register_cache_tensor(bytes_per_sector,
   non_trash_bytes, cache_tensor, pool)` ends with `_after_cache_tensor_init(...)`; `rows_per_token == 2` (a page
   of a layer is page_size key rows then page_size value rows, addressed by the physical indices of
   `get_read_indices` / `get_write_indices`); `update(key_states, value_states, layer_idx, read_index,
   write_index)` with `[tokens, heads, head_dim]` states; `sentinel_index` marks the new tokens of a sliding read;
   `supports_block_table` gates the decode fast path (`PagedAttentionCache._infer_max_decode_fast_path_length`);
   `_copy_view` (block copies for forks and CPU offloading) is the raw byte tensor viewed per block.
4. The attention functions (`integrations.sdpa_attention.sdpa_attention_forward`, `flash_attention_forward`,
   `eager_paged.eager_paged_attention_forward`) call `cache.update(key_states=, value_states=, layer_idx=,
   kwargs=)` on any `PagedAttentionCache` instance (our subclass is one).
"""

from __future__ import annotations

import inspect


class UnsupportedTransformersError(RuntimeError):
    """This transformers version changed an internal that hf_kvcache.paged relies on."""


def _fail(internal: str, detail: str) -> None:
    import transformers

    raise UnsupportedTransformersError(
        f"hf_kvcache.paged relies on transformers internal `{internal}`, which changed in transformers "
        f"{transformers.__version__} ({detail}); quantized pages are unavailable with this version (tested with 5.23)."
    )


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def check_internals() -> None:
    """Raise UnsupportedTransformersError naming the first internal (see the module docstring) that changed."""
    try:
        from transformers.generation.continuous_batching import cache as cb_cache
        from transformers.generation.continuous_batching import continuous_api
        from transformers.generation.continuous_batching.cache_allocators import (
            CacheAllocator,
            FullAttentionCacheAllocator,
            SlidingAttentionCacheAllocator,
        )
    except ImportError as error:
        _fail("transformers.generation.continuous_batching", f"import failed: {error}")

    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    if not hasattr(continuous_api, "PagedAttentionCache") or manager is None:
        _fail("continuous_api.PagedAttentionCache", "the module no longer has this name")
    if "PagedAttentionCache(" not in _source(getattr(manager, "_create_batch_processor", None)):
        _fail("ContinuousBatchingManager._create_batch_processor", "no longer calls PagedAttentionCache(...)")

    cache_cls = cb_cache.PagedAttentionCache
    expected = ["self", "config", "continuous_batching_config", "device", "distributed_helper", "dtype",
                "model_supports_logits_to_keep"]
    if _params(cache_cls.__init__) != expected:
        _fail("PagedAttentionCache.__init__", f"parameters {_params(cache_cls.__init__)}, expected {expected}")
    mapping = getattr(cb_cache, "ATTN_TYPE_TO_ALLOCATOR", None)
    if not isinstance(mapping, dict) or set(mapping) != {"full_attention", "sliding_attention"}:
        _fail("cache.ATTN_TYPE_TO_ALLOCATOR", f"expected a dict for full/sliding attention, got {mapping!r}")
    init_source = _source(cache_cls.__init__)
    if "ATTN_TYPE_TO_ALLOCATOR[" not in init_source or "bytes_per_block" not in init_source:
        _fail("PagedAttentionCache.__init__", "no longer builds allocators from ATTN_TYPE_TO_ALLOCATOR[...]")
    if "supports_block_table" not in _source(cache_cls._infer_max_decode_fast_path_length):
        _fail("PagedAttentionCache._infer_max_decode_fast_path_length", "no longer reads supports_block_table")
    if _params(cache_cls.update) != ["self", "key_states", "value_states", "layer_idx", "kwargs"]:
        _fail("PagedAttentionCache.update", f"parameters {_params(cache_cls.update)}")

    allocator_init = ["self", "index", "config", "num_key_value_heads", "cache_dtype", "page_size", "layer_indices",
                      "allow_block_sharing"]
    for cls in (FullAttentionCacheAllocator, SlidingAttentionCacheAllocator):
        name = cls.__name__
        if _params(cls.__init__) != allocator_init:
            _fail(f"{name}.__init__", f"parameters {_params(cls.__init__)}, expected {allocator_init}")
        if _params(cls.update) != ["self", "key_states", "value_states", "layer_idx", "read_index", "write_index"]:
            _fail(f"{name}.update", f"parameters {_params(cls.update)}")
        if getattr(cls, "rows_per_token", None) != 2:
            _fail(f"{name}.rows_per_token", "a page is no longer key rows then value rows")
    if "self.get_bytes_per_page(" not in _source(FullAttentionCacheAllocator.__init__):
        _fail("FullAttentionCacheAllocator.__init__", "no longer sizes pages with self.get_bytes_per_page(...)")
    if _params(FullAttentionCacheAllocator.register_cache_tensor) != [
        "self", "bytes_per_sector", "non_trash_bytes", "cache_tensor", "pool"
    ]:
        _fail("FullAttentionCacheAllocator.register_cache_tensor",
              f"parameters {_params(FullAttentionCacheAllocator.register_cache_tensor)}")
    for attr in ("_after_cache_tensor_init", "get_read_indices", "get_write_indices", "free_blocks"):
        if not hasattr(CacheAllocator, attr) and not hasattr(FullAttentionCacheAllocator, attr):
            _fail(f"CacheAllocator.{attr}", "missing")
    if "sentinel_index" not in _source(CacheAllocator._after_cache_tensor_init):
        _fail("CacheAllocator.sentinel_index", "the sliding read no longer marks new tokens with a sentinel")
    if "_copy_view" not in _source(FullAttentionCacheAllocator.register_cache_tensor):
        _fail("FullAttentionCacheAllocator._copy_view", "block copies no longer use the raw byte view")

    from transformers.integrations import eager_paged, flash_attention, sdpa_attention

    for module, fn in ((sdpa_attention, "sdpa_attention_forward"), (flash_attention, "flash_attention_forward"),
                       (eager_paged, "eager_paged_attention_forward")):
        source = _source(getattr(module, fn, None))
        if "cache.update(" not in source:
            _fail(f"{module.__name__}.{fn}", "no longer calls cache.update(...) on the paged cache")
