"""Prompt eviction on head pages (hf_kvcache.paged.head_pages): each (layer, KV head) of a request keeps its own
tokens. The method's scorer scores each head's tokens (the layer whole when its heads hold the same tokens, head by
head when, chunk by chunk, they hold different ones; KVzap's arrival scores carried per head), head_allotment chooses
what each keeps, and the allocator moves each head's rows to its front and frees its tail pages."""

from __future__ import annotations

import torch

from ..scorers.base import Prompt
from .compress_spec import FIELD
from .head_allotment import kept_positions_per_head
from .prompt_scores import reads


def compress_heads(eviction, state, info, kept: int) -> tuple[int, int]:
    """Keep `kept` tokens per head on average of `state`'s request (its RequestCompression `info`, on `eviction`'s
    cache). Returns (pages freed, tokens kept per head on average: the request's new `position_offset`)."""
    allocator = next(iter(eviction.cache.cache_allocators.values()))
    request_id, device, heads = state.request_id, eviction.cache.device, allocator.num_key_value_heads
    lengths = allocator.lengths[request_id]
    scores, arrived = [], {}
    for layer, layer_idx in enumerate(allocator.layer_indices):
        own = lengths[layer * heads : (layer + 1) * heads]
        if "arrived" in reads(info.spec.method):
            arrived[layer] = _head_arrivals(info, layer_idx, own, device)
        scores.append(_head_scores(eviction, info, allocator, request_id, layer, layer_idx, own, arrived.get(layer)))
    positions = kept_positions_per_head(info.spec, scores, kept)
    freed = allocator.compact(request_id, positions)
    for layer, per_head in arrived.items():  # chunk by chunk: the kept tokens' arrival scores carry on
        layer_idx = allocator.layer_indices[layer]
        info.head_arrived[layer_idx] = [per_head[h][positions[layer * heads + h]] for h in range(heads)]
        info.arrived[layer_idx] = []
    return freed, -(-sum(p.numel() for p in positions) // len(positions))


def _head_arrivals(info, layer_idx: int, lengths: list[int], device) -> list[torch.Tensor]:
    """The arrival scores of each head's tokens at a layer: those its kept tokens carried, then the newer ones."""
    heads = len(lengths)
    new = torch.cat(info.arrived.get(layer_idx) or [torch.zeros(heads, 0, device=device)], -1)
    carried = info.head_arrived.get(layer_idx) or [new.new_zeros(0)] * heads
    arrived = [torch.cat([carried[h], new[h]]) for h in range(heads)]
    if [a.numel() for a in arrived] != lengths:
        raise RuntimeError(
            f"{FIELD}: {info.spec.method} scored {[a.numel() for a in arrived]} tokens per head at layer {layer_idx}, "
            f"which holds {lengths}"
        )
    return arrived


def _head_scores(eviction, info, allocator, request_id, layer: int, layer_idx: int, lengths: list[int], arrived):
    """A layer's scores per head (1-D tensors of each head's tokens, in page order) from what the method reads: its
    pages (per head when the heads hold different tokens), its arrival scores (`arrived`), its queries."""
    scorer, wanted, device = eviction._scorer(info, layer_idx), reads(info.spec.method), eviction.cache.device
    if scorer is None:  # sink_window: positions only
        return [torch.zeros(n, device=device) for n in lengths]
    if arrived is not None:
        if len(set(lengths)) == 1:
            return list(scorer.score(Prompt(arrived=torch.stack(arrived))).float())
        return [scorer.score(Prompt(arrived=a[None]))[0].float() for a in arrived]
    if len(set(lengths)) == 1:  # every head holds the same tokens: the scorer sees the layer whole
        keys = allocator.read_keys(request_id, layer, lengths[0], device) if "keys" in wanted else None
        prompt = eviction._prompt(info, None, layer_idx, torch.arange(lengths[0], device=device), keys=keys)
        return list(scorer.score(prompt).float())
    if wanted != ("keys",):
        raise RuntimeError(f"{FIELD}: {info.spec.method} cannot score heads that hold different tokens")
    out = []
    for h, n in enumerate(lengths):
        keys = allocator.read_stream_keys(request_id, layer * len(lengths) + h, n, device)  # [n, D]
        out.append(scorer.score(Prompt(keys=keys[None])).float()[0])
    return out


__all__ = ["compress_heads"]
