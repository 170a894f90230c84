"""`hf-kvcache serve` with faults injected, for tests/test_serve_http.py (run as `python fault_injecting_serve.py serve
...`): a request asking for `max_tokens` COMPACTION_FAULT raises in its prompt's compaction, and every forward whose
batch holds a request asking for FORWARD_FAULT raises at layer 1's cache update. Nothing else changes."""

from __future__ import annotations

import sys

from hf_kvcache.cli.app import main
from hf_kvcache.paged import eviction
from hf_kvcache.paged.cache import QuantizedPagedAttentionCache

COMPACTION_FAULT, FORWARD_FAULT = 7, 5
_batch: set[int] = set()
_compress, _before_forward, _update = (
    eviction.PagedEviction._compress,
    eviction.PagedEviction.before_forward,
    QuantizedPagedAttentionCache.update,
)


def _faulty_compress(self, state, info, final):
    if state.max_new_tokens == COMPACTION_FAULT:
        raise RuntimeError("injected compaction fault")
    return _compress(self, state, info, final)


def _noting_before_forward(self, processor, model):
    _batch.clear()
    _batch.update(f.state.max_new_tokens for f in processor.inputs_and_outputs.requests_in_batch)
    return _before_forward(self, processor, model)


def _faulty_update(self, key_states, value_states, layer_idx, kwargs):
    if FORWARD_FAULT in _batch and layer_idx == 1:
        raise RuntimeError("injected forward fault")
    return _update(self, key_states, value_states, layer_idx, kwargs)


eviction.PagedEviction._compress = _faulty_compress
eviction.PagedEviction.before_forward = _noting_before_forward
QuantizedPagedAttentionCache.update = _faulty_update

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
