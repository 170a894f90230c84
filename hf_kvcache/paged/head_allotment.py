"""Which prompt positions each (layer, KV head) of a request keeps in head pages (hf_kvcache.paged.head_pages): the
per-head scores of the registry scorer (`Scorer.score`, [Hkv, P] per layer), allotted as KVzipCache allots its
budget, by the same functions:
- over the layers (`layer_budget` "adaptive", KVzip's `layer_budgets`): the best `budget x heads x layers` (head,
  token) pairs over the whole model, each layer's share of them its pool; "uniform": `budget x heads` per layer;
- over a layer's heads (`head_budget` "adaptive", AdaKV's `adaptive_keep`): each head its `safeguard` share of the
  layer's average per-head budget (sinks and window included, as KVzipCache's placed layer counts it), then the layer's
  best over all its heads until the pool is full; "uniform": `budget` per head, each its own best.
The first `sinks` and newest `recent` positions (CompressSpec.protected) are kept in every head and are part of the
budget, as they are in KVzipCache; the rest of the budget is scored."""

from __future__ import annotations

import torch

from ..policies.head_budgets import adaptive_keep
from ..policies.kvzip import layer_budgets
from .compress_spec import CompressSpec


def kept_positions_per_head(spec: CompressSpec, prompt: int, scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """`scores`: per layer [Hkv, prompt] (higher = keep). Returns per stream (layer-major, layer x Hkv + head) the
    ascending positions kept; on average over the streams spec.kept(prompt) exactly."""
    layer_budget, head_budget, safeguard = spec.allotment()
    heads, device = scores[0].shape[0], scores[0].device
    kept = spec.kept(prompt)
    sinks, recent = spec.protected(kept)
    scored = kept - sinks - recent  # per head, on average
    positions = torch.arange(prompt, device=device)
    protected = torch.cat([positions[:sinks], positions[prompt - recent :] if recent else positions[:0]])
    if scored <= 0:
        return [protected.sort().values for _ in scores for _ in range(heads)]
    candidates = [s.float()[None, :, sinks : prompt - recent] for s in scores]  # [1, Hkv, n] each
    if layer_budget == "adaptive":
        pools = layer_budgets(candidates, [scored] * len(scores), heads)
    else:
        pools = [scored * heads] * len(scores)
    out = []
    for pool, candidate in zip(pools, candidates):
        if head_budget == "adaptive":  # the floor of KVzipCache's placed layer: its per-head average, sinks in
            floor = max(0, int((pool // heads + sinks + recent) * safeguard) - sinks)
            chosen = adaptive_keep(candidate, pool, floor)[0]  # [Hkv, n] bool
        else:
            per_head = min(pool // heads, candidate.shape[-1])
            top = candidate[0].topk(per_head, dim=-1).indices
            chosen = torch.zeros_like(candidate[0], dtype=torch.bool).scatter_(-1, top, True)
        for h in range(heads):
            out.append(torch.cat([protected, sinks + chosen[h].nonzero()[:, 0]]).sort().values)
    return out
