"""Heavy hitters under a token budget: what the scorer caches, KVzip's placement and prompt mode place with.

`ScoredPolicy(budget, recent, scorer)` is `HeavyHitterPolicy` sized by a `budget` (tokens, or a ratio of the prompt
in (0, 1], resolved at the first forward) of which the `recent` newest tokens are the window, `heavy` = budget -
recent. With `sinks` > 0 the tokens at position ids below `sinks` (each row's first real tokens, so left padding is
accounted for) are never evicted either. `recent_share`: the window is at least that share of the budget
(decode-time eviction protects the newest tokens by default: see hf_kvcache.caches.scorers). `rescore_every`: decode
steps re-score the stored tokens every N steps (scorers that re-score). `total`: under head-adaptive budgets, the
layer's pool when the model allots it (KVzip's layer-adaptive budgets).

Unlike H2O's accumulated attention, most scorers' scores are current: each selection ranks the candidates by the
scorer's value at that moment (hf_kvcache.scorers).
"""

from __future__ import annotations

from ..scorers.base import Scorer
from .heavy_hitter import HeavyHitterPolicy, resolve_size


class ScoredPolicy(HeavyHitterPolicy):
    def __init__(
        self,
        budget,
        recent: int,
        scorer: Scorer,
        sinks: int = 0,
        recent_share: float = 0.0,
        rescore_every: int = 1,
        total: int | None = None,
    ):
        self.budget_spec, self.recent_share, self.rescore_every = budget, recent_share, rescore_every
        self.recent_given = recent  # (HeavyHitterPolicy.recent_spec is the resolved window for token budgets)
        if isinstance(budget, float):
            super().__init__(budget, recent, scorer)  # resolved in configure
        else:
            recent = self._recent_for(budget)
            if recent > budget:
                raise ValueError(f"`recent` ({recent}) must not exceed `budget` ({budget}).")
            super().__init__(budget - recent, recent, scorer)
        self.recent_tokens, self.sinks = recent, sinks
        self.total = total

    def _recent_for(self, budget: int) -> int:
        """The protected window: `recent`, or `recent_share` of the budget when that is more."""
        return max(self.recent_given, int(round(self.recent_share * budget)))

    def configure(self, prompt_length: int) -> None:
        if self.heavy is None:
            budget = resolve_size("budget", self.budget_spec, prompt_length)
            self.recent_tokens = self._recent_for(budget)
            if self.recent_tokens > budget:
                raise ValueError(
                    f"`budget` {self.budget_spec} of a {prompt_length}-token prompt is {budget} tokens, fewer than "
                    f"`recent` ({self.recent_tokens}); give a larger budget or a smaller recent window."
                )
            self.heavy, self.recent = budget - self.recent_tokens, self.recent_tokens
            self.capacity = budget

    def size_for(self, heads: int) -> None:
        super().size_for(heads)
        if self.total is not None and self.pool_heads:
            self.capacity = self.total

    def reset(self) -> None:
        super().reset()
        if isinstance(self.budget_spec, float):
            self.heavy = self.recent = self.capacity = None
