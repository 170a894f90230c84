"""Regions by role and age, for CompositeCache: sinks | ring tiers by age | a final region.

- sinks: each row's first `sinks` real tokens, never evicted (optionally re-positioned as in StreamingLLM);
- tiers: ring buffers holding the tokens whose age (tokens since) is in [start, end); rings are indexed by the
  token's stream index, so a token keeps its slot while it stays in a tier and moves only when it ages into the
  next one (one move per tier boundary per decode step);
- final: what happens to tokens older than the last tier: "evict" them, "keep" them all (a growing region), or
  keep the `heavy` ones with the highest scores, per row and KV head. The `scorer` ranks them (hf_kvcache.scorers:
  H2O's accumulated attention by default); this policy is its host: it keeps the per-slot scores and moves them,
  and the scorer's per-slot state, with their tokens.
Each region's slots can live in a store of its own precision (see stores/regions.py).

Pooled (`pooled=True`, heavy hitters at the last tier's precision): the last tier's ring and the heavy slots are one
pool. A token entering the last tier takes the pool slot of the token evicted now (the lowest score among the pool's
tokens that are past the tier's end, empty slots first, as HeavyHitterPolicy does) and keeps that slot until it is
evicted: nothing moves from the tier to the heavy region. The tokens kept are those of the unpooled layout (the tier
holds its ages, the heavy slots the top-`heavy` older tokens, chosen one step at a time); exact ties in scores may be
broken differently.
"""

from __future__ import annotations

import torch

from ..common.compile_static import StaticInt, fixed_shape
from ..common.rope import KeyRotator
from ..scorers.base import Scorer
from ..scorers.h2o import H2O
from .base import Placement, ScorerHost
from .sinks import SinkMemory

FINAL_KINDS = ("evict", "keep", "heavy")


class CompositePolicy(ScorerHost):
    may_have_holes = True
    # sizes fixed for the cache's life: torch.compile specialises on them (hf_kvcache.common.compile_static)
    sinks, heavy, final_base = StaticInt(), StaticInt(), StaticInt()
    tier_sizes, ends, starts, bases = StaticInt(), StaticInt(), StaticInt(), StaticInt()
    # Decode traces whole (slots and region hints are Python ints of the stream position, symbolic under torch.compile
    # after the warm-up; sizes and buffers are constants, hf_kvcache.common.compile_static) and compiled equals eager
    # with no
    # recompilation (tests/test_compile.py). Compiled SmolLM2 decode (CPU, inductor): 1.04x / 1.13x compiled H2O at
    # budgets 256 / 1024 (eval/results/composite_decode_compiled.json).
    compileable = True
    state, parts = ("n_real", "stream", "scores"), ("memory", "scorer")

    def __init__(
        self,
        sinks: int,
        tier_sizes: list[int],
        final: str,
        heavy: int = 0,
        rotator: KeyRotator | None = None,
        pooled: bool = False,
        scorer: Scorer | None = None,
    ):
        if pooled and (final != "heavy" or not tier_sizes):
            raise ValueError(
                f"`pooled` needs heavy hitters after at least one tier (final={final!r}, {len(tier_sizes)} tiers)."
            )
        self.sinks, self.tier_sizes, self.final, self.heavy = sinks, list(tier_sizes), final, heavy
        self.pooled = pooled
        self.rotator = rotator
        ends = [sum(tier_sizes[: i + 1]) for i in range(len(tier_sizes))]
        self.ends, self.starts = ends, [0] + ends[:-1]
        self.bases = [sinks + start for start in self.starts]
        self.final_base = sinks + (ends[-1] if ends else 0)
        self.capacity = None if final == "keep" else self.final_base + (heavy if final == "heavy" else 0)
        self.pool_tier = len(self.tier_sizes) - 1 if pooled else None  # its ring and the heavy slots: one pool
        self.per_head = final == "heavy"
        # what ranks the heavy hitters (H2O by default); without a heavy region, no scores at all
        self.scorer = (scorer or H2O()) if final == "heavy" else Scorer()
        self.n_real = self.stream = self.scores = None
        self._sink_step = True  # whether the tokens being placed may include sinks (decode knows when they cannot)
        self.memory = SinkMemory(sinks, rotator)

    sink_slots = property(lambda self: self.sinks)  # the scorer's host contract: slots that are never candidates

    # -- state --------------------------------------------------------------------------------------------------
    def allocate(self, batch: int, heads: int, device) -> None:
        self.heads = heads
        self.n_real = torch.zeros(batch, dtype=torch.long, device=device)
        self.memory.allocate(batch, device)

    def _ensure_meta(self, view) -> None:
        slots = view.valid.shape[-1]
        if self.stream is None or self.stream.shape[-1] != slots:
            pad = slots - (0 if self.stream is None else self.stream.shape[-1])
            base = view.valid.new_zeros(view.valid.shape[:2] + (0,), dtype=torch.long)
            stream = self.stream if self.stream is not None else base
            self.stream = torch.nn.functional.pad(stream, (0, pad), value=-1)
            scores = self.scores if self.scores is not None else base.float()
            self.scores = torch.nn.functional.pad(scores, (0, pad))
            fixed_shape(self.stream, self.scores)

    def used_after(self, seen: int) -> int:
        if seen == 0:
            return 0
        used = self.sinks
        for base, start, size in zip(self.bases, self.starts, self.tier_sizes):
            filled = min(size, max(0, seen - start))
            if filled == 0:
                return used
            used = base + filled
            if filled < size:
                return used
        overflow = max(0, seen - (self.ends[-1] if self.ends else 0))
        if self.final == "keep":
            return self.final_base + overflow
        if self.final == "heavy":
            return self.final_base + min(self.heavy, overflow)
        return used

    def has_evicted(self, seen: int) -> bool:
        return self.final != "keep" and seen > (self.ends[-1] if self.ends else 0) + self.sinks + (
            self.heavy if self.final == "heavy" else 0
        )

    # -- moving tokens between regions --------------------------------------------------------------------------
    def _region_hint(self, view, slots) -> tuple | None:
        """Regions of host-known slots (decode), for region stores; None when unknown or not a region store."""
        if slots is None or not view.has_regions:
            return None
        return tuple(view.region_of(s) for s in slots)

    def _move(self, view, src: torch.Tensor, dest: torch.Tensor, src_slots=None, dest_slots=None) -> None:
        """Move tokens from slots `src` to `dest` ([B, Hm, n]; dest -1 = drop), vacating the sources. `src_slots`,
        `dest_slots`: the Python slot numbers they can be, when known on the host (decode), so region stores need
        not read the device to know which regions are involved."""
        stream, scores = self.stream.gather(2, src), self.scores.gather(2, src)
        self.stream.scatter_(2, src, -1)  # vacated: no stale stream index left to be moved again (after a crop)
        dest = view.move(src, dest, self._region_hint(view, src_slots), self._region_hint(view, dest_slots))
        self.stream.scatter_(2, dest, stream)
        self.scores.scatter_(2, dest, scores)
        self.scorer.move(src, dest)

    def _ring_slot(self, tier: int, u: torch.Tensor) -> torch.Tensor:
        return self.bases[tier] + u.remainder(self.tier_sizes[tier])

    def _sink_split(self, real: torch.Tensor):
        real_index = self.n_real[:, None] + real.long().cumsum(-1) - 1
        self.n_real = self.n_real + real.long().sum(-1)
        is_sink = real & (real_index < self.sinks)
        return is_sink, torch.where(is_sink, real_index, -1)

    def _heavy_keep(
        self,
        key: torch.Tensor,
        in_heavy_slot: torch.Tensor,
        cur_slot: torch.Tensor,
        base: int | None = None,
        size: int | None = None,
    ) -> torch.Tensor:
        """Targets among candidates [B, Hm, n] for the `size` slots from `base` (default: the heavy slots): the top
        `size` by key; occupants keep their slot, newcomers take free slots (lowest first); -1 for the rest."""
        batch, heads, n = key.shape
        base = self.final_base if base is None else base
        size = self.heavy if size is None else size
        k = min(size, n)
        kept = torch.zeros_like(in_heavy_slot).scatter_(-1, key.topk(k, dim=-1).indices, True) & (key > float("-inf"))
        stays = kept & in_heavy_slot
        occupied = torch.zeros(batch, heads, size + 1, dtype=torch.bool, device=key.device)
        occupied.scatter_(-1, torch.where(stays, cur_slot - base, size), True)
        slot_ids = torch.arange(size, device=key.device) + base
        free_sorted = torch.where(occupied[..., :size], base + size + 1, slot_ids).sort(-1).values
        newcomers = kept & ~in_heavy_slot
        rank = (newcomers.long().cumsum(-1) - 1).clamp(min=0)
        target = torch.where(newcomers, free_sorted.gather(-1, rank), -1)
        return torch.where(stays, cur_slot, target)

    # -- decode ---------------------------------------------------------------------------------------------------
    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        self._ensure_meta(view)
        batch, q = real.shape
        device = real.device
        if q > 1:  # (deferred scorers place chunks in observe)
            return self._place_chunk(view, real, seen, self.scorer.chunk_scores(self, view, real, seen))
        hm = view.valid.shape[1]
        t = seen
        if self.per_head and self.scorer.rescores and t >= self.capacity - self.sinks:  # a selection is due
            self.scorer.before_selection(self, view, real)
        for tier in reversed(range(len(self.tier_sizes))):
            u = t - self.ends[tier]
            if u < 0 or tier == self.pool_tier:  # (the pool's oldest stay in their slots, as eviction candidates)
                continue
            src_slot = self.bases[tier] + u % self.tier_sizes[tier]
            src = torch.full((batch, hm, 1), src_slot, device=device)
            if tier + 1 == self.pool_tier:
                dest_slots = [self.bases[tier + 1]]  # some pool slot
                dest = self._pool_victim(view, t)
            elif tier + 1 < len(self.tier_sizes):
                dest_slots = [self.bases[tier + 1] + u % self.tier_sizes[tier + 1]]
                dest = torch.full_like(src, dest_slots[0])
            elif self.final == "keep":
                dest_slots = [self.final_base + u]
                dest = torch.full_like(src, dest_slots[0])
            elif self.final == "heavy":
                dest_slots = [self.final_base]  # some heavy slot, or dropped
                heavy_slots = torch.arange(self.final_base, self.final_base + self.heavy, device=device)
                cand_key = torch.where(view.valid.gather(2, src), self.scores.gather(2, src), float("-inf"))
                occupant_key = torch.where(view.valid[..., heavy_slots], self.scores[..., heavy_slots], float("-inf"))
                key = torch.cat((occupant_key, cand_key), -1)
                cur = torch.cat((heavy_slots.expand(batch, hm, -1), src), -1)
                in_heavy = torch.zeros_like(key, dtype=torch.bool)
                in_heavy[..., : self.heavy] = True
                targets = self._heavy_keep(key, in_heavy, cur)
                victims = in_heavy & (targets < 0) & (key > float("-inf"))
                view.evict(~victims[..., : self.heavy], start=self.final_base)
                dest = targets[..., self.heavy :]
            else:
                dest_slots = []
                dest = torch.full_like(src, -1)
            self._move(view, src, dest, [src_slot], dest_slots)
        # a token can only be a sink while its stream index is below `sinks` (its real index is at most that), or in
        # a padded stream, where a row's real index lags its stream index (left padding)
        may_be_sink = t < self.sinks or view.padded
        if self.pool_tier == 0:  # the new token enters the pool: the slot of the token evicted now, per row and head
            ring_slot, ring_dest = self.bases[0], self._pool_victim(view, t)
        elif self.tier_sizes:
            ring_slot = self.bases[0] + t % self.tier_sizes[0]
            ring_dest = torch.full((batch, 1, 1), ring_slot, dtype=torch.long, device=device)
        else:
            ring_slot = ring_dest = None
        self._sink_step = may_be_sink
        if may_be_sink:
            is_sink, sink_dest = self._sink_split(real)
            placement = self._placement(real, is_sink, sink_dest, ring_dest, real & ~is_sink, hm)
        else:  # no sink: only the ring (or pool) entry, and the sinks' memory has nothing to record
            self.n_real += real.sum(-1)
            placement = Placement(
                src=torch.zeros(batch, hm, 1, dtype=torch.long, device=device),
                dest=ring_dest.expand(batch, hm, 1).contiguous(),
                valid=real[:, None].expand(batch, hm, 1),
            )
        placement.regions = self._region_hint(
            view, ([0] if may_be_sink else []) + ([ring_slot] if ring_slot is not None else [])
        )
        return placement

    def _pool_victim(self, view, t: int) -> torch.Tensor:
        """[B, Hm, 1] the pool slot freed for the token entering the pool at step `t`: among the pool's slots whose
        token is past the pool tier's end after this step (or empty), the lowest score, invalid ones first."""
        lo, hi = self.bases[self.pool_tier], self.capacity
        stream = self.stream[..., lo:hi]
        key = torch.where(view.valid[..., lo:hi], self.scores[..., lo:hi], float("-inf"))
        # still in the tier after this step (empty slots, stream -1, never are: the threshold is at least -1)
        key = torch.where(stream > max(t - self.ends[self.pool_tier], -1), float("inf"), key)
        return key.argmin(-1, keepdim=True) + lo

    def _placement(self, real, is_sink, sink_dest, ring_dest, ring_valid, hm) -> Placement:
        """Each new token twice: to its sink slot (valid if a sink) and to `ring_dest` [B, 1 or Hm, q] (valid if
        not)."""
        batch, q = real.shape
        src = torch.arange(q, device=real.device).expand(batch, q)
        if ring_dest is None:
            ring_dest, ring_valid = torch.full_like(sink_dest, -1)[:, None], torch.zeros_like(real)
        return Placement(
            src=torch.cat((src, src), -1)[:, None].expand(batch, hm, 2 * q),
            dest=torch.cat((sink_dest[:, None].expand(batch, hm, q), ring_dest.expand(batch, hm, q)), -1).contiguous(),
            valid=torch.cat((is_sink, ring_valid), -1)[:, None].expand(batch, hm, 2 * q),
        )

    # -- multi-token chunks ---------------------------------------------------------------------------------------
    def _place_chunk(self, view, real: torch.Tensor, seen: int, new_scores: torch.Tensor | None) -> Placement:
        """Re-place past non-sink tokens and the new chunk by age (vectorised version of one-token steps)."""
        self._sink_step = True
        batch, q = real.shape
        device = real.device
        hm = view.valid.shape[1]
        seen_after = seen + q
        used = max(view.used, self.sinks)
        is_sink, sink_dest = self._sink_split(real)
        past = torch.arange(self.sinks, used, device=device).expand(batch, hm, -1)
        new_u = (seen + torch.arange(q, device=device)).expand(batch, hm, q)
        cand_u = torch.cat((self.stream[..., self.sinks : used], new_u), -1)
        cand_valid = torch.cat((view.valid[..., self.sinks : used], (real & ~is_sink)[:, None].expand(-1, hm, -1)), -1)
        cand_cur = torch.cat((past, torch.full_like(new_u, -1)), -1)
        age = seen_after - 1 - cand_u
        target = torch.full_like(cand_u, -1)
        for tier in range(len(self.tier_sizes)):
            if tier == self.pool_tier:
                continue
            inside = (age >= self.starts[tier]) & (age < self.ends[tier])
            target = torch.where(inside, self._ring_slot(tier, cand_u), target)
        older = age >= (self.ends[-1] if self.ends else 0)
        if self.pooled:  # the pool tier's ages all stay (even padding: it holds its ring place), then the top scores
            entered = age >= self.starts[self.pool_tier]
            score = torch.cat((self.scores[..., self.sinks : used], new_scores), -1)
            key = torch.where(older & cand_valid, score, float("-inf"))
            key = torch.where(entered & ~older, float("inf"), key)
            lo = self.bases[self.pool_tier]
            in_pool = (cand_cur >= lo) & (cand_cur < self.capacity)
            pool_target = self._heavy_keep(key, in_pool, cand_cur, lo, self.capacity - lo)
            target = torch.where(entered, pool_target, target)
        elif self.final == "keep":
            target = torch.where(older, self.final_base + cand_u, target)
        elif self.final == "heavy":
            score = torch.cat((self.scores[..., self.sinks : used], new_scores), -1)
            key = torch.where(older & cand_valid, score, float("-inf"))
            in_heavy = (cand_cur >= self.final_base) & (cand_cur < self.final_base + self.heavy)
            heavy_target = self._heavy_keep(key, in_heavy, cand_cur)
            target = torch.where(older, heavy_target, target)
        n_past = used - self.sinks
        moving = (target[..., :n_past] != cand_cur[..., :n_past]) & (cand_u[..., :n_past] >= 0)
        if n_past:  # tokens that stay are moved from the trash slot to nowhere (no host read to skip them)
            src = torch.where(moving, cand_cur[..., :n_past], view.trash_slot)
            dest = torch.where(moving, target[..., :n_past], -1)
            self._move(view, src, dest)
        new_target = target[..., n_past:]
        src = torch.arange(q, device=device).expand(batch, hm, q)
        sinks = Placement(
            src=src, dest=sink_dest[:, None].expand(batch, hm, q), valid=is_sink[:, None].expand(batch, hm, q)
        )
        return Placement(
            src=torch.cat((sinks.src, src), -1),
            dest=torch.cat((sinks.dest, new_target), -1).contiguous(),
            valid=torch.cat((sinks.valid, (real & ~is_sink)[:, None].expand(batch, hm, q) & (new_target >= 0)), -1),
        )

    def observe(self, view, column_scores: torch.Tensor) -> None:
        self._ensure_meta(view)
        self._place_pending(view, self.scorer.observe(self, view, column_scores))

    def observe_queries(self, view, query: torch.Tensor) -> None:
        self._ensure_meta(view)
        self._place_pending(view, self.scorer.observe_queries(self, view, query))

    def _place_pending(self, view, scores: torch.Tensor | None) -> None:
        """Place the pending chunk, given the scorer's scores [B, Hm, used + q] of the stored and new tokens (None:
        decode, nothing pending)."""
        if scores is None:
            return
        used = view.used
        real, seen_before = view.pending.real, view.pending.seen_before
        placement = self._place_chunk(view, real, seen_before, scores[..., used:])
        view.commit(placement)
        q = real.shape[1]
        dest = torch.where(placement.dest[..., q:] >= 0, placement.dest[..., q:], view.trash_slot)
        self.scores.scatter_(2, dest, scores[..., used:])
        sink_dest = torch.where(placement.dest[..., :q] >= 0, placement.dest[..., :q], view.trash_slot)
        self.scores.scatter_(2, sink_dest, scores[..., used:])

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        self._ensure_meta(view)
        scores = self.scorer.arrival(self, view, placement, keys, dest, seen_before)
        if scores is None:  # set later: by observe (attention scorers) or the next selection
            self.scores.scatter_(2, dest, 0.0)
        else:
            self.scores.scatter_(2, dest, scores)
        self.stream.scatter_(2, dest, seen_before + placement.src)
        if self._sink_step:
            self.memory.record(placement, keys, dest, positions, seen_before)

    def before_read(self, view) -> None:
        self.memory.reposition(view, view.used)

    def crop(self, view, new_seen: int) -> None:
        self._ensure_meta(view)
        view.evict(self.stream < new_seen)
        self.stream = torch.where(self.stream < new_seen, self.stream, -1)  # cropped slots are empty again (pool)
        view.evict(self.memory.kept_after_crop(new_seen)[:, None])
        self.n_real = view.valid[:, 0, : self.sinks].long().sum(-1) + (
            view.valid[:, 0, self.sinks :] & (self.stream[:, 0, self.sinks :] >= 0)
        ).long().sum(-1)
        # The survivors are younger now: move them to the regions of their new ages, as a chunk of no tokens does
        # (nothing was evicted, so they all fit). Without this they stayed where their old ages put them.
        batch, hm = view.valid.shape[:2]
        self._place_chunk(view, view.valid.new_zeros(batch, 0), new_seen, self.scores.new_zeros(batch, hm, 0))
