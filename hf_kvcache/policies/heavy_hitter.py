"""Heavy hitters: keep the recent window plus the older tokens a scorer ranks highest, per batch row and KV head.

The host of a scorer (hf_kvcache.scorers): this policy owns the per-slot scores [B, H, slots + 1] (float32) and the
stream index of each slot's token, the scorer says what the scores are (H2O's accumulated attention by default: arXiv
2306.14048). Padding tokens are invalid and never kept; scores of evicted tokens are dropped.

- Multi-token forwards (prefill, chunked prefill): the stored past and the whole chunk compete; the policy keeps the
  recent window and the top-scoring rest. Scorers that need the chunk's attention or queries make the policy
  `deferred`: placement waits for the bridge to hand them over (`observe` / `observe_queries`).
- Decode (one token): the token evicted is chosen before attention, by the scores so far (re-scored first by scorers
  that do, every `rescore_every` steps): the lowest scoring token outside the new recent window. The new token takes
  its slot in place, so the cache and attention hold exactly `heavy + recent` tokens.

Positions: original by default. With a `rotator` ("compact"), the kept tokens of each row and head are placed at
contiguous positions ending at the newest one, as StreamingLLM does for sinks: keys are re-rotated before each
read from a copy kept as they arrived (exact; the copy is counted in `nbytes`).
"""

from __future__ import annotations

import torch

from ..common.compile_static import StaticInt, fixed_shape
from ..scorers.base import Scorer
from ..scorers.h2o import AGGREGATIONS, H2O  # noqa: F401  (AGGREGATIONS: H2OCache's `aggregation` values)
from .base import Placement, ScorerHost
from .head_budgets import adaptive_keep, pool_destinations, pool_victims


def resolve_size(name: str, value, prompt_length: int) -> int:
    """Token counts stay as they are; ratios in (0, 1] are fractions of the prompt length (at least one token)."""
    if isinstance(value, float):
        return max(1, int(round(value * prompt_length)))
    return value


class HeavyHitterPolicy(ScorerHost):
    per_head = True
    may_have_holes = True
    heavy, recent = StaticInt(), StaticInt()  # torch.compile specialises on them (hf_kvcache.common.compile_static)
    sinks = 0  # position ids below it are never evicted (ScoredPolicy; H2O keeps none)
    sink_slots = 0  # slots before the scored ones (the composite's sinks region; none here)
    rescore_every = 1
    state, transient, parts = ("scores", "stream", "arrived_keys"), ("_new_scores",), ("scorer",)

    def __init__(self, heavy, recent, scorer: Scorer | None = None, rotator=None):
        self.heavy_spec, self.recent_spec = heavy, recent
        self.scorer = H2O() if scorer is None else scorer
        self.rotator = rotator
        self.arrived_keys: torch.Tensor | None = None  # compact positions: keys as they arrived, per slot
        self.heavy = self.recent = None
        self.capacity = None if isinstance(heavy, float) or isinstance(recent, float) else heavy + recent
        if self.capacity is not None:
            self.heavy, self.recent = heavy, recent
        self.scores: torch.Tensor | None = None  # [B, H, slots + 1] the scorer's scores (float32)
        self.stream: torch.Tensor | None = None  # [B, H, slots + 1] stream index of each slot's token
        self._new_scores: torch.Tensor | None = None  # a chunk's new tokens' scores, until they are written
        # head-adaptive budgets (policies/head_budgets.py): one pool of budget x heads slots for the layer's heads
        self.adaptive, self.safeguard = False, 0.2
        self.pool_heads: int | None = None
        # rank by the attention a token received per query that saw it (kvpress's ObservedAttentionPress) instead of
        # the accumulated sum, which favours old tokens (more queries saw them)
        self.average = False

    compileable = property(lambda self: self.scorer.compileable)

    def configure(self, prompt_length: int) -> None:
        if self.heavy is None:
            self.heavy = resolve_size("heavy", self.heavy_spec, prompt_length)
            self.recent = resolve_size("recent", self.recent_spec, prompt_length)
            self.capacity = self.heavy + self.recent

    def size_for(self, heads: int) -> None:
        if self.adaptive:
            self.pool_heads = heads
            self.capacity = (self.heavy + self.recent) * heads

    @property
    def floor(self) -> int:
        """Tokens each head keeps at least under head-adaptive budgets (AdaKV's safeguard share of the budget)."""
        return int((self.heavy + self.recent) * self.safeguard)

    def allocate(self, batch: int, heads: int, device) -> None:
        self.scores = torch.zeros(batch, heads, self.capacity + 1, dtype=torch.float32, device=device)
        self.stream = torch.full((batch, heads, self.capacity + 1), -1, dtype=torch.long, device=device)
        fixed_shape(self.scores, self.stream)
        self.scorer.allocate(self, batch, heads, device)

    def _ranked(self, scores: torch.Tensor, stream: torch.Tensor, now: int) -> torch.Tensor:
        """What selections compare: the scores, or with `average` their mean over the `now - stream` queries that
        attended each token (queries at stream indices stream .. now - 1)."""
        return scores / (now - stream).clamp_min(1) if self.average else scores

    def protect(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Sinks (position id < `sinks`) score +inf: never evicted."""
        if self.sinks == 0:
            return scores
        return torch.where(positions < self.sinks, float("inf"), scores)

    # -- placement --------------------------------------------------------------------------------------------------
    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        if real.shape[1] == 1 and seen > 0:
            if self.scorer.rescores:
                budget = self.heavy + self.recent  # (per head; under head-adaptive budgets the pool holds it x heads)
                if seen >= budget and (seen - budget) % self.rescore_every == 0:
                    self.scorer.before_selection(self, view, real)
                    c = self.capacity
                    self.scores[..., :c] = self.protect(self.scores[..., :c], view.positions[..., :c])
            return self._place_decode(view, real, seen)
        new_scores = self.scorer.chunk_scores(self, view, real, seen)
        if new_scores is None:
            raise RuntimeError(f"{type(self).__name__} places chunks after attention (deferred)")
        return self.select_chunk(view, real, seen, view.incoming.positions, new_scores)

    def select_chunk(self, view, real, seen_before: int, positions, new_scores) -> Placement:
        """Keep the recent window and the best-scoring rest among the stored tokens (their scores in `self.scores`,
        as the scorer left them) and the new ones (new_scores [B, H, q])."""
        used = view.used
        if used and self.sinks:
            self.scores[..., :used] = self.protect(self.scores[..., :used], view.positions[..., :used])
        new_scores = self.protect(new_scores.float(), positions[:, None, :])
        self._new_scores = new_scores
        return self._select(view, real, seen_before, new_scores)

    # -- decode: choose the victim before attention ---------------------------------------------------------------
    def _place_decode(self, view, real: torch.Tensor, seen: int) -> Placement:
        batch, _q = real.shape
        heads = self.scores.shape[1]
        src = torch.zeros(batch, heads, 1, dtype=torch.long, device=real.device)
        valid = real[:, None, :].expand(batch, heads, 1)
        if self.pool_heads:  # a pool slot of its own for the new token in every head
            c = self.capacity
            stream = self.stream[..., :c]
            key = self._ranked(self.scores[..., :c], stream, seen)
            key = torch.where(stream > seen - self.recent, float("inf"), key)
            victims = pool_victims(key, view.valid[..., :c], self.floor)  # [B, H]
            view.evict(torch.ones_like(view.valid[:, :1, :c]).scatter_(2, victims[:, None], False))
            return Placement(src=src, dest=victims[..., None], valid=valid)
        if seen < self.capacity:
            return Placement(src=src, dest=torch.full_like(src, seen), valid=valid)
        c = self.capacity
        slot_valid, stream = view.valid[..., :c], self.stream[..., :c]
        in_recent = slot_valid & (stream > seen - self.recent)  # stays in the window with token `seen`
        key = torch.where(slot_valid, self._ranked(self.scores[..., :c], stream, seen), float("-inf"))
        key = torch.where(in_recent, float("inf"), key)
        return Placement(src=src, dest=key.argmin(-1, keepdim=True), valid=valid)

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        self.stream.scatter_(2, dest, seen_before + placement.src)
        scores = self.scorer.arrival(self, view, placement, keys, dest, seen_before)
        if self._new_scores is not None:  # a chunk: the scores it was selected by
            scores, self._new_scores = self._new_scores.gather(2, placement.src.expand(dest.shape)), None
        elif scores is not None or self.sinks:
            if scores is None:
                scores = keys.new_zeros(keys.shape[:3], dtype=torch.float32)
            token_positions = positions.gather(1, placement.src.expand(dest.shape)[:, 0])[:, None]
            scores = self.protect(scores, token_positions)
        if scores is None:  # set later: by `observe` or the next selection
            self.scores.scatter_(2, dest, 0.0)
        else:
            self.scores.scatter_(2, dest, scores)
        if self.rotator is not None:
            if self.arrived_keys is None:
                self.arrived_keys = keys.new_zeros(keys.shape[:2] + view.valid.shape[-1:] + keys.shape[-1:])
            index = dest[..., None].expand(-1, -1, -1, keys.shape[-1])
            self.arrived_keys.scatter_(2, index, keys.to(self.arrived_keys.dtype))

    def before_read(self, view) -> None:
        """Compact positions: rank kept tokens by original position, place them just before the newest."""
        if self.rotator is None or self.arrived_keys is None or not self.has_evicted(view.seen):
            return
        used = view.used
        valid, original = view.valid[..., :used], view.positions[..., :used].long()
        order = torch.where(valid, original, torch.iinfo(torch.long).max).argsort(-1)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(used, device=order.device).expand_as(order))
        newest = torch.where(valid, original, torch.iinfo(torch.long).min).amax(-1, keepdim=True)
        target = torch.where(valid, newest - valid.long().sum(-1, keepdim=True) + 1 + rank, original)
        rotated = self.rotator.rotate(self.arrived_keys[:, :, :used], target - original, view.layer_idx)
        view.write_keys(0, rotated)

    # -- scores from the bridge ---------------------------------------------------------------------------------
    def observe(self, view, column_scores: torch.Tensor) -> None:
        self._place_pending(view, self.scorer.observe(self, view, column_scores))

    def observe_queries(self, view, query: torch.Tensor) -> None:
        self._place_pending(view, self.scorer.observe_queries(self, view, query))

    def _place_pending(self, view, scores: torch.Tensor | None) -> None:
        """Place the pending chunk by the scorer's scores [B, H, used + q] of the stored and new tokens (None:
        decode, the scorer updated the stored scores)."""
        if view.pending is None:
            if self.sinks:
                self.scores[..., :-1] = self.protect(self.scores[..., :-1], view.positions[..., :-1])
            return
        pending = view.pending
        new_scores = scores[..., view.used :]
        view.commit(self.select_chunk(view, pending.real, pending.seen_before, pending.positions, new_scores))

    def _select(self, view, real: torch.Tensor, seen_before: int, new_scores: torch.Tensor) -> Placement:
        """Keep the recent window and the top-scoring rest among the stored past and the new chunk."""
        batch, heads, q = new_scores.shape
        used, c = view.used, self.capacity
        device = new_scores.device
        new_stream = (seen_before + torch.arange(q, device=device)).expand(batch, heads, q)
        new_valid = real[:, None, :].expand(batch, heads, q)
        cand_valid = torch.cat((view.valid[..., :used], new_valid), -1)
        cand_stream = torch.cat((self.stream[..., :used], new_stream), -1)
        key = self._ranked(torch.cat((self.scores[..., :used], new_scores), -1), cand_stream, seen_before + q)
        key = torch.where(cand_valid, key, float("-inf"))
        key = torch.where(cand_valid & (cand_stream >= seen_before + q - self.recent), float("inf"), key)
        if self.pool_heads:
            kept = adaptive_keep(key, c, self.floor)
            view.evict(kept[..., :used])  # evicted past tokens free their pool slots
            dest = pool_destinations(kept[..., used:], view.valid[..., :c].any(1))
            src = torch.arange(q, device=device).expand(batch, heads, q)
            return Placement(src=src, dest=dest, valid=new_valid & kept[..., used:])
        if used + q <= c:
            kept = torch.ones_like(cand_valid)
        else:
            kept = torch.zeros_like(cand_valid).scatter_(-1, key.topk(c, dim=-1).indices, True)
        kept_past, kept_new = kept[..., :used], kept[..., used:]
        view.evict(kept_past)  # evicted past tokens free their slots
        free = torch.cat((~kept_past, torch.ones(batch, heads, c - used, dtype=torch.bool, device=device)), -1)
        slot_ids = torch.arange(c, device=device).expand(batch, heads, c)
        free_sorted = torch.where(free, slot_ids, c + 1).sort(-1).values
        rank = (kept_new.long().cumsum(-1) - 1).clamp(min=0)
        dest = torch.where(kept_new, free_sorted.gather(-1, rank), -1)
        src = torch.arange(q, device=device).expand(batch, heads, q)
        return Placement(src=src, dest=dest, valid=new_valid & kept_new)

    def used_after(self, seen: int) -> int:
        return min(seen * (self.pool_heads or 1), self.capacity)

    def has_evicted(self, seen: int) -> bool:
        return self.capacity is not None and seen * (self.pool_heads or 1) > self.capacity

    def crop(self, view, new_seen: int) -> None:
        view.evict(self.stream < new_seen)

    def reset(self) -> None:
        super().reset()
        if isinstance(self.heavy_spec, float) or isinstance(self.recent_spec, float):
            self.heavy = self.recent = self.capacity = None
