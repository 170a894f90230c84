"""transformers' paged-cache memory handler, sized for head pages (hf_kvcache.paged.head_pages).

`PagedAttentionCache.__init__` sizes its index tensors and attention masks with `PagedAttentionMemoryHandler`, counting
a page's tokens as tokens of every layer and head. A head page holds one (layer, KV head) stream's, so for a cache of
head pages the handler is told (`tokens_per_sector_divided`) to count `tokens_per_sector / streams`; the `head_pages`
patch (hf_kvcache.integration.patches) puts `per_stream_memory_handler`'s subclass in place of transformers' handler,
which outside that block behaves exactly as transformers'."""

from __future__ import annotations

import contextlib
import threading

from transformers.generation.continuous_batching import cache as cb_cache

from .contracts import contract, parameters, source

HEAD_PAGES = "PagedAttentionCache.__init__ sizes its memory with PagedAttentionMemoryHandler(tokens_per_sector=...)"


@contract(
    HEAD_PAGES,
    "PagedAttentionCache.__init__ sizes its index tensors and masks by calling the module-level "
    "PagedAttentionMemoryHandler(..., tokens_per_sector=...)",
    "head pages (kv_compress_layout 'head')",
)
def _check_head_pages() -> str | None:
    handler = getattr(cb_cache, "PagedAttentionMemoryHandler", None)
    if handler is None or "tokens_per_sector" not in parameters(handler.__init__):
        return "PagedAttentionMemoryHandler(..., tokens_per_sector) is gone"
    if "PagedAttentionMemoryHandler(" not in source(cb_cache.PagedAttentionCache.__init__):
        return "PagedAttentionCache.__init__ no longer sizes memory with PagedAttentionMemoryHandler"
    return None


_STREAMS = threading.local()  # the divisor while a head-paged cache is built (`tokens_per_sector_divided`)


def per_stream_memory_handler(original):
    """transformers' PagedAttentionMemoryHandler, which, while `tokens_per_sector_divided` is active in this thread,
    counts `tokens_per_sector / divisor` tokens per sector and returns whole numbers of sectors and batch tokens;
    otherwise exactly transformers' (the `head_pages` patch of hf_kvcache.integration.patches)."""

    class PerStreamMemoryHandler(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            divisor = getattr(_STREAMS, "divisor", None)
            self._hf_kvcache_whole = divisor is not None
            if divisor is not None:
                self.tokens_per_sector = self.tokens_per_sector / divisor

        def infer_max_batch_tokens_and_num_sectors(self):
            max_batch_tokens, num_sectors = super().infer_max_batch_tokens_and_num_sectors()
            if self._hf_kvcache_whole:
                return int(max_batch_tokens), int(num_sectors)
            return max_batch_tokens, num_sectors

    PerStreamMemoryHandler.__doc__ = per_stream_memory_handler.__doc__
    return PerStreamMemoryHandler


@contextlib.contextmanager
def tokens_per_sector_divided(divisor: int):
    """While a paged cache is built in this block (this thread): transformers' memory handler sizes the index tensors
    and attention masks for `tokens_per_sector / divisor` tokens per sector (head pages: a page holds one of
    `divisor` (layer, head) streams of its tokens, where transformers counts whole tokens). Needs the `head_pages`
    patch installed."""
    _STREAMS.divisor = divisor
    try:
        yield
    finally:
        _STREAMS.divisor = None


__all__ = ["HEAD_PAGES", "per_stream_memory_handler", "tokens_per_sector_divided"]
