"""A request's rows in transformers' pages, as prompt eviction (hf_kvcache.paged.eviction) moves and frees them:
the rows of a layer by physical token index (transformers' `_kv_token_views`, or our quantized allocator's byte rows),
its keys as attention reads them, and the pages past the kept tokens given back to the pool."""

from __future__ import annotations

import torch


def token_rows(allocator, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value rows of a layer, indexed by physical token index (what moves when tokens move)."""
    own = getattr(allocator, "token_rows", None)
    return own(layer_idx) if own is not None else allocator._kv_token_views[layer_idx]


def read_keys(allocator, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
    """A layer's keys [n, Hkv, D] at physical rows `rows`, as attention reads them (dequantized, unrotated)."""
    own = getattr(allocator, "read_keys", None)
    return own(layer_idx, rows) if own is not None else allocator._kv_token_views[layer_idx][0].index_select(0, rows)


def free_tail(allocator, request_id: str, kept: int) -> int:
    """Give back the pages of `request_id` past its first `kept` tokens; returns how many."""
    table = allocator.block_table[request_id]
    keep = -(-kept // allocator.tokens_per_page)
    tail = table[keep:]
    del table[keep:]
    freed = [block for block in tail if allocator.ledger.release(block, no_cache=True)]
    allocator.pool.free_blocks(allocator.index, freed)
    return len(tail)
