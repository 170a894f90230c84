"""Quantized pages for transformers' continuous batching (docs/serving.md).

One module per job: `spec` (what a page holds, read from the continuous-batching config), `records` (byte layout of a
token and the codec views over it), `allocators` (transformers' cache allocators with quantized pages), `cache` (the
PagedAttentionCache subclass, `install`, `enable_paged`; the transformers internals relied on are checked in
hf_kvcache.integration.continuous_batching); `server` (`hf-kvcache serve`: transformers' HTTP server with these pages,
sized from a KV memory) with `serve_requests` (what it refuses with HTTP 400) and `serve_process` (the server in a
subprocess, for tests and eval/bench_serve_http.py). Prompt eviction (`kv_compress`): `compress_spec` (what a request
keeps), `prompt_scores` (the scorers' per-token scores on a prompt as the pages hold it), `eviction` (the compaction
inside continuous batching) with `eviction_checks` (what can run, before a run), `page_rows` (a request's rows and
pages) and `request_specs` (the settings requests named), and `serve_compression` (the server's default and a request's
own). What measures them (`serve-bench`, the eviction reference) is the harness's: hf_kvcache.evaluation.
"""

from ..integration.versions import UnsupportedTransformersError
from .cache import QuantizedPagedAttentionCache, enable_paged, install
from .spec import KV_DTYPES, PagedKVSpec

__all__ = [
    "KV_DTYPES",
    "PagedKVSpec",
    "QuantizedPagedAttentionCache",
    "UnsupportedTransformersError",
    "enable_paged",
    "install",
]
