"""Which positions each (layer, KV head) of a request keeps in head pages (hf_kvcache.paged.head_pages): the per-head
scores of the registry scorer (`Scorer.score`), allotted as KVzipCache allots its budget, by the same functions:
- over the layers (`layer_budget` "adaptive", KVzip's `layer_budgets`): the best `budget x heads x layers` (head,
  token) pairs over the whole model, each layer's share of them its pool; "uniform": `budget x heads` per layer;
- over a layer's heads (`head_budget` "adaptive", AdaKV's `adaptive_keep`): each head its `safeguard` share of the
  layer's average per-head budget (sinks and window included, as KVzipCache's placed layer counts it), then the layer's
  best over all its heads until the pool is full; "uniform": `budget` per head, each its own best.
The first `sinks` and newest `recent` tokens of every head (CompressSpec.protected) are kept and are part of the
budget, as they are in KVzipCache; the rest of the budget is scored.

A head's tokens are indexed in the order they lie in its pages (their original order). Chunk by chunk (`chunk`), the
heads of a request hold different numbers of tokens (what each kept, then the chunk written after): the scores are
ragged, one 1-D tensor per head, and the candidates a head lacks count as -inf."""

from __future__ import annotations

import torch

from ..policies.head_budgets import adaptive_keep
from ..policies.kvzip import layer_budgets
from .compress_spec import CompressSpec


def kept_positions_per_head(spec: CompressSpec, scores: list, kept: int | None = None) -> list[torch.Tensor]:
    """`scores`: per layer, [Hkv, n] or a list of Hkv 1-D tensors (one per head, its tokens in page order; higher =
    keep). Returns per stream (layer-major: layer x Hkv + head) the ascending indices it keeps: `kept` per head on
    average (None: spec.kept(n) of the longest head), fewer where the heads hold fewer candidates than their share."""
    layers = [list(s) for s in scores]
    heads, device = len(layers[0]), layers[0][0].device
    lengths = [[int(h.numel()) for h in layer] for layer in layers]
    kept = spec.kept(max(max(n) for n in lengths)) if kept is None else kept
    sinks, recent = spec.protected(kept)
    scored = kept - sinks - recent  # per head, on average
    protected = [[_protected(n, sinks, recent, device) for n in layer] for layer in lengths]
    if scored <= 0:
        return [p for layer in protected for p in layer]
    widest = max(max(n) for n in lengths) - sinks - recent
    candidates = []
    for layer in layers:  # [1, Hkv, widest]: a head's candidates, -inf past them
        padded = torch.full((1, heads, max(widest, 1)), float("-inf"), device=device)
        for h, s in enumerate(layer):
            part = s.float()[sinks : s.numel() - recent]
            padded[0, h, : part.numel()] = part
        candidates.append(padded)
    if spec.allotment()[0] == "adaptive":
        pools = layer_budgets(candidates, [scored] * len(layers), heads)
    else:
        pools = [scored * heads] * len(layers)
    safeguard = spec.allotment()[2]
    out = []
    for pool, candidate, layer_protected in zip(pools, candidates, protected):
        if spec.allotment()[1] == "adaptive":  # the floor of KVzipCache's placed layer: its per-head average
            floor = max(0, int((pool // heads + sinks + recent) * safeguard) - sinks)
            chosen = adaptive_keep(candidate, pool, floor)[0]  # [Hkv, widest] bool
        else:
            per_head = min(pool // heads, candidate.shape[-1])
            top = candidate[0].topk(per_head, dim=-1).indices
            chosen = torch.zeros_like(candidate[0], dtype=torch.bool).scatter_(-1, top, True)
            chosen &= candidate[0] > float("-inf")
        for h in range(heads):
            out.append(torch.cat([layer_protected[h], sinks + chosen[h].nonzero()[:, 0]]).sort().values)
    return out


def _protected(n: int, sinks: int, recent: int, device) -> torch.Tensor:
    """A head's first `sinks` and newest `recent` indices of its `n` tokens."""
    head = torch.arange(min(sinks, n), device=device)
    tail = torch.arange(max(sinks, n - recent), n, device=device)
    return torch.cat([head, tail])
