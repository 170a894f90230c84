"""Head-adaptive budgets (AdaKV, Feng et al., arXiv 2407.11550): a layer keeps `budget x kv_heads` tokens in all,
allotted to its KV heads by score, instead of `budget` in every head.

AdaKV's selection (as kvpress's AdaKVPress implements it, reviewed by the paper's first author): each head first
keeps its `floor = int(budget x safeguard)` best tokens (safeguard 0.2 by default), then the layer keeps the best of
the rest over all its heads together until it holds `budget x kv_heads`. Scores must be comparable across heads
(attention probabilities, expected attention, normalised key statistics are).

Unlike kvpress, which only masks the dropped tokens, the kept tokens live in one slot pool per layer
(hf_kvcache.stores.head_pool): every (row, head) token has a pool slot of its own and the layer's per-head validity
says which head it belongs to, so the memory held is the budget. These functions choose; HeavyHitterPolicy places.
"""

from __future__ import annotations

import torch


def adaptive_keep(score: torch.Tensor, total: int, floor: int) -> torch.Tensor:
    """score [B, H, n] (-inf: not a candidate, +inf: must stay) -> kept [B, H, n]: each head's `floor` best
    candidates, then the best over all heads up to `total` kept per row (fewer when there are fewer candidates)."""
    batch, heads, n = score.shape
    candidate = score > float("-inf")
    if floor > 0:
        safe = torch.zeros_like(candidate).scatter_(-1, score.topk(min(floor, n), dim=-1).indices, True)
        score = torch.where(safe & candidate & (score < float("inf")), torch.finfo(score.dtype).max, score)
    flat = score.reshape(batch, heads * n)
    kept = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, flat.topk(min(total, heads * n), dim=-1).indices, True)
    return kept.view(batch, heads, n) & candidate


def pool_destinations(kept_new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """kept_new [B, H, q] (the new tokens each head keeps), held [B, c] (pool slots still held by some head) ->
    dest [B, H, q]: distinct free slots, lowest first, in (head, token) order; -1 where not kept."""
    batch, heads, q = kept_new.shape
    c = held.shape[-1]
    slot_ids = torch.arange(c, device=held.device).expand(batch, c)
    free_sorted = torch.where(held, c + 1, slot_ids).sort(-1).values
    flat = kept_new.reshape(batch, heads * q)
    rank = (flat.long().cumsum(-1) - 1).clamp(min=0).clamp(max=c - 1)
    return torch.where(flat, free_sorted.gather(-1, rank), -1).view(batch, heads, q)


def pool_victims(key: torch.Tensor, valid: torch.Tensor, floor: int) -> torch.Tensor:
    """The H pool slots [B, H] that one decode step frees for its new token in each of the H heads: empty slots
    first (lowest first), then the lowest `key` [B, H, c] (+inf: protected) over all heads, a head losing at most as
    many as keep it at `floor` tokens once its new token is in (count + 1 - floor). valid [B, H, c]: which head holds
    each slot."""
    heads = valid.shape[1]
    owned = valid.any(1)  # [B, c]
    key = torch.where(valid, key, float("inf"))
    rank = key.argsort(dim=-1, stable=True).argsort(dim=-1)  # each slot's rank within its head, lowest key first
    may_lose = valid.sum(-1, keepdim=True) + 1 - floor  # [B, H, 1]
    owner_key = torch.where(valid & (rank < may_lose), key, float("inf")).amin(1)  # [B, c]
    slot_key = torch.where(owned, owner_key, float("-inf"))
    # stable: empty slots lowest first, so a pool still filling stays within the first `used_after` slots
    return slot_key.sort(dim=-1, stable=True).indices[..., :heads]
