"""Heavy hitters chosen by a scorer: what the scorer policies (knorm, keydiff, tova, snapkv, expected_attention)
share.

A scorer maps what it reads (keys, values, the forward's queries, or the attention of the last queries) to one score
per token and KV head, higher = more worth keeping; the policy decides. The placement is H2O's
(`HeavyHitterPolicy`): per batch row and KV head, the `recent` newest tokens plus the `heavy` best-scoring older ones;
padding is never kept. With `sinks` > 0 the tokens at position ids below `sinks` (each row's first real tokens, so
left padding is accounted for) are never evicted either.

Unlike H2O's accumulated attention, scores are current: each selection ranks the candidates by the scorer's value at
that moment.
- Multi-token forwards (prefill, chunks): the stored tokens and the new ones compete (`select_chunk`).
- Decode: the victim is chosen before attention, by `self.scores` (HeavyHitterPolicy.place); a subclass refreshes
  them first (`refresh`) and scores the new token after its write (`arrival_scores`).

Budgets: `budget` tokens (int) or a ratio of the prompt (float in (0, 1]), of which `recent` tokens are the window;
`heavy` = budget - recent.
"""

from __future__ import annotations

import torch

from .base import Placement
from .heavy_hitter import HeavyHitterPolicy, resolve_size


def group_mean(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, n] -> [B, Hkv, n]: mean over the query heads of each KV group (GQA, as kvpress averages)."""
    batch, q_heads, n = scores.shape
    return scores.view(batch, kv_heads, q_heads // kv_heads, n).mean(2)


class ScoredPolicy(HeavyHitterPolicy):
    compileable = False  # decode refreshes scores from data of varying layout; not traced with fullgraph
    deferred = False  # key scorers place chunks at once; attention / query scorers set these
    needs_attention = False

    def __init__(self, budget, recent: int, sinks: int = 0, recent_share: float = 0.0, rescore_every: int = 1):
        self.budget_spec, self.recent_share, self.rescore_every = budget, recent_share, rescore_every
        self.recent_given = recent  # (HeavyHitterPolicy.recent_spec is the resolved window for token budgets)
        if isinstance(budget, float):
            super().__init__(budget, recent)  # resolved in configure
        else:
            recent = self._recent_for(budget)
            if recent > budget:
                raise ValueError(f"`recent` ({recent}) must not exceed `budget` ({budget}).")
            super().__init__(budget - recent, recent)
        self.recent_tokens, self.sinks = recent, sinks
        self._new_scores: torch.Tensor | None = None

    def _recent_for(self, budget: int) -> int:
        """The protected window: `recent`, or `recent_share` of the budget when that is more (decode-time eviction
        protects the newest tokens by default: see hf_kvcache.caches.scorers)."""
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

    def reset(self) -> None:
        super().reset()
        if isinstance(self.budget_spec, float):
            self.heavy = self.recent = self.capacity = None
        self._new_scores = None

    # -- scores -------------------------------------------------------------------------------------------------
    def protect(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Sinks (position id < `sinks`) score +inf: never evicted."""
        if self.sinks == 0:
            return scores
        return torch.where(positions < self.sinks, float("inf"), scores)

    def arrival_scores(self, view, keys: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Scores [B, H, n] of tokens written outside a chunk selection (decode); keys [B, H, n, D] as written,
        src [B, H or 1, n] their index in the forward's tokens. Default 0 (the next `refresh` or `observe` sets
        them)."""
        return keys.new_zeros(keys.shape[:3], dtype=torch.float32)

    def refresh(self, view, real: torch.Tensor) -> None:
        """Bring `self.scores` of the stored slots up to date before a decode step chooses its victim."""

    def select_chunk(self, view, real, seen_before: int, positions, past_scores, new_scores) -> Placement:
        """Keep the recent window and the best-scoring rest among the stored tokens (past_scores [B, H, used]) and
        the new ones (new_scores [B, H, q])."""
        used = view.used
        if used:
            self.scores[..., :used] = self.protect(past_scores, view.positions[..., :used])
        new_scores = self.protect(new_scores.float(), positions[:, None, :])
        self._new_scores = new_scores
        return self._select(view, real, seen_before, new_scores)

    # -- placement ----------------------------------------------------------------------------------------------
    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        if real.shape[1] == 1 and seen > 0:
            budget = self.heavy + self.recent  # (per head; under head-adaptive budgets the pool holds it x heads)
            if seen >= budget and (seen - budget) % self.rescore_every == 0:
                self.refresh(view, real)
            return super().place(view, real, seen)
        return self.place_chunk(view, real, seen)

    def place_chunk(self, view, real, seen: int) -> Placement:
        raise NotImplementedError(f"{type(self).__name__} places chunks after attention (deferred)")

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        super().after_write(view, placement, keys, dest, positions, seen_before)
        src = placement.src.expand(dest.shape)
        if self._new_scores is not None:
            scores = self._new_scores.gather(2, src)
            self._new_scores = None
        else:
            token_positions = positions.gather(1, src[:, 0])[:, None]
            scores = self.protect(self.arrival_scores(view, keys, src), token_positions)
        self.scores.scatter_(2, dest, scores)

    def observe(self, view, column_scores: torch.Tensor) -> None:
        raise RuntimeError(f"{type(self).__name__} does not use attention scores")
