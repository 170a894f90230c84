"""What ranks the heavy hitters of CompositeCache's `heavy` region: one scorer object per layer's CascadePolicy.

The scores are the per-slot tensor `policy.scores` [B, Hm, slots + 1] of the CascadePolicy (higher = kept); the
policy places tokens, moves them between regions (carrying their scores) and picks the heavy hitters by those scores.
A scorer only says what the scores are, through these hooks:
- `chunk_scores(policy, layer, real)`: a multi-token forward of a scorer that needs neither attention nor queries
  (placed at once): the new tokens' scores [B, Hm, q]; it may re-score the stored ones (policy.scores[..., :used]).
- `observe(policy, layer, column_scores)` / `observe_queries(policy, layer, query)`: from the bridge, for scorers
  that need attention (`needs_attention`) or the forward's queries (`needs_queries`). In decode (no pending chunk)
  they update the stored scores and return None; for a pending chunk they update the stored tokens' scores and
  return the scores [B, Hm, used + q] of the stored and the new tokens (the policy then places the chunk).
- `before_selection(policy, layer, real)`: a decode step in which a heavy selection is due; scorers whose scores
  are relative to the current candidates re-score the stored tokens here.
- `arrival(policy, layer, placement, keys, dest)`: after the new tokens were written to slots `dest`: their scores
  (None: 0, set later by `observe`), and any per-slot state of the scorer for them.
- `move(src, dest)`: the policy moved tokens from slots src to dest (dest may be the trash slot): per-slot state
  of the scorer follows them. `map_batch`, `reset`, `nbytes`: as for policies.

The scorers, each the scorer function of its standalone policy, so that a composite of one recent window and heavy
hitters keeps the tokens the standalone cache keeps:
- "h2o" (heavy_hitter.py): attention received, accumulated (aggregated over each KV group's query heads);
- "tova" (tova.py): the last query's attention, layer-wide mean, replaced at every forward (`attention_window` 1);
- "knorm" (knorm.py): minus the key norm, fixed at arrival; no attention is computed;
- "keydiff" (keydiff.py): key diversity, re-scored over the stored keys and the new ones before each selection; no
  attention is computed.
"""

from __future__ import annotations

from typing import Callable

import torch

from .heavy_hitter import HeavyHitterPolicy
from .keydiff import keydiff_scores
from .knorm import knorm_scores
from .tova import tova_scores


class HeavyScorer:
    """No scores: the composite without a heavy region (its tokens are evicted or all kept)."""

    needs_attention = False
    needs_queries = False
    attention_window: int | None = None

    @property
    def deferred(self) -> bool:  # chunks are placed after the bridge hands over what the scores need
        return self.needs_attention or self.needs_queries

    def chunk_scores(self, policy, layer, real: torch.Tensor) -> torch.Tensor | None:
        return None

    def observe(self, policy, layer, column_scores: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{type(self).__name__} does not use attention scores")

    def observe_queries(self, policy, layer, query: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{type(self).__name__} does not use queries")

    def before_selection(self, policy, layer, real: torch.Tensor) -> None:
        pass

    def arrival(self, policy, layer, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        return None

    def move(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        pass

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        pass

    def reset(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class H2OScorer(HeavyScorer):
    needs_attention = True

    def __init__(self, aggregation: str):
        self.aggregation = HeavyHitterPolicy(0, 0, aggregation)  # its `aggregate` over each KV group's query heads

    def _scores(self, column_scores: torch.Tensor, heads: int) -> torch.Tensor:
        return self.aggregation.aggregate(column_scores, heads)

    def _update(self, stored: torch.Tensor, scores: torch.Tensor) -> None:
        stored += scores  # accumulated

    def observe(self, policy, layer, column_scores: torch.Tensor) -> torch.Tensor | None:
        scores = self._scores(column_scores, layer.slot_valid.shape[1])
        n = scores.shape[-1] if layer._pending is None else layer.used
        self._update(policy.scores[..., :n], scores[..., :n])
        return None if layer._pending is None else scores


class TOVAScorer(H2OScorer):
    attention_window = 1  # the last query's attention only

    def __init__(self):
        pass

    def _scores(self, column_scores: torch.Tensor, heads: int) -> torch.Tensor:
        return tova_scores(column_scores, heads)

    def _update(self, stored: torch.Tensor, scores: torch.Tensor) -> None:
        stored.copy_(scores)  # replaced by each forward's last query


class KnormScorer(HeavyScorer):
    def chunk_scores(self, policy, layer, real: torch.Tensor) -> torch.Tensor:
        return knorm_scores(layer.incoming[0])

    def arrival(self, policy, layer, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        return knorm_scores(keys)  # fixed at arrival


class KeyDiffScorer(HeavyScorer):
    def __init__(self):
        self._chunk_scores: torch.Tensor | None = None  # the new tokens' scores of a chunk, until they are written

    def _candidates(self, layer, real: torch.Tensor, n_stored: int) -> torch.Tensor:
        """KeyDiff scores [B, Hm, n_stored + q] of the first `n_stored` slots and the incoming tokens, the anchor
        taken over the valid ones (as KeyDiffPolicy does)."""
        keys = layer.incoming[0]
        stored = layer.store.read(n_stored)[0] if n_stored else keys[:, :, :0]
        candidates = torch.cat((stored, keys.to(stored.dtype)), 2)
        valid = torch.cat((layer.slot_valid[..., :n_stored], real[:, None].expand(-1, keys.shape[1], -1)), -1)
        return keydiff_scores(candidates, valid)

    def chunk_scores(self, policy, layer, real: torch.Tensor) -> torch.Tensor:
        used = layer.used
        scores = self._candidates(layer, real, used)
        policy.scores[..., :used] = scores[..., :used]
        self._chunk_scores = scores[..., used:]
        return self._chunk_scores

    def before_selection(self, policy, layer, real: torch.Tensor) -> None:
        c = policy.capacity
        policy.scores[..., :c] = self._candidates(layer, real, c)[..., :c]

    def arrival(self, policy, layer, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        if self._chunk_scores is None:  # decode: scored by the next selection
            return None
        scores = self._chunk_scores.gather(2, placement.src.expand(dest.shape))
        self._chunk_scores = None
        return scores

    def reset(self) -> None:
        self._chunk_scores = None


HEAVY_SCORERS = ("h2o", "tova", "knorm", "keydiff")  # which scores rank the heavy hitters


def make_heavy_scorer(name: str | None, aggregation: str = "sum") -> HeavyScorer:
    """The scorer called `name` (one of HEAVY_SCORERS), or no scorer (None: no heavy region)."""
    if name is None:
        return HeavyScorer()
    if name == "h2o":
        return H2OScorer(aggregation)
    return {"tova": TOVAScorer, "knorm": KnormScorer, "keydiff": KeyDiffScorer}[name]()
