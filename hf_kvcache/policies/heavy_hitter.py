"""H2O (arXiv 2306.14048): keep the recent window plus the "heavy hitters", the older tokens that received the most
attention, per batch row and per KV head.

A token's score is the attention probability it has received, accumulated over queries (float32), for its KV head
(for GQA the query heads of a group are aggregated: "sum" by default, "mean" or "max"). Scores of evicted tokens are
dropped; padding tokens are invalid and never heavy hitters.

- Multi-token forwards (prefill, chunked prefill): attention sees the stored past plus the whole chunk, then the
  policy keeps the recent window and the top-scoring rest (`deferred`: placement waits for the chunk's scores).
- Decode (one token): the token evicted is chosen before attention, by the scores accumulated so far: the lowest
  scoring token outside the new recent window. The new token takes its slot in place, so the cache and attention
  hold exactly `heavy + recent` tokens.

Positions: original by default. With a `rotator` ("compact"), the kept tokens of each row and head are placed at
contiguous positions ending at the newest one, as StreamingLLM does for sinks: keys are re-rotated before each
read from a copy kept as they arrived (exact; the copy is counted in `nbytes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.compile_static import StaticInt, fixed_shape
from ..common.tensor_parallel import SINGLE_PROCESS, TensorParallel
from .base import Placement, Policy
from .head_budgets import adaptive_keep, pool_destinations, pool_victims

AGGREGATIONS = ("sum", "mean", "max")


def resolve_size(name: str, value, prompt_length: int) -> int:
    """Token counts stay as they are; ratios in (0, 1] are fractions of the prompt length (at least one token)."""
    if isinstance(value, float):
        return max(1, int(round(value * prompt_length)))
    return value


class HeavyHitterPolicy(Policy):
    compileable = True
    per_head = True
    may_have_holes = True
    heavy, recent = StaticInt(), StaticInt()  # torch.compile specialises on them (hf_kvcache.common.compile_static)
    deferred = True
    needs_attention = True

    def __init__(self, heavy, recent, aggregation: str = "sum", rotator=None):
        self.heavy_spec, self.recent_spec, self.aggregation = heavy, recent, aggregation
        self.rotator = rotator
        self.arrived_keys: torch.Tensor | None = None  # compact positions: keys as they arrived, per slot
        self.heavy = self.recent = None
        self.capacity = None if isinstance(heavy, float) or isinstance(recent, float) else heavy + recent
        if self.capacity is not None:
            self.heavy, self.recent = heavy, recent
        self.scores: torch.Tensor | None = None  # [B, H, slots + 1] accumulated attention (float32)
        self.stream: torch.Tensor | None = None  # [B, H, slots + 1] stream index of each slot's token
        # head-adaptive budgets (policies/head_budgets.py): one pool of budget x heads slots for the layer's heads
        self.adaptive, self.safeguard = False, 0.2
        self.pool_heads: int | None = None
        # rank by the attention a token received per query that saw it (kvpress's ObservedAttentionPress) instead of
        # the accumulated sum, which favours old tokens (more queries saw them)
        self.average = False

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

    def _ranked(self, scores: torch.Tensor, stream: torch.Tensor, now: int) -> torch.Tensor:
        """What selections compare: the scores, or with `average` their mean over the `now - stream` queries that
        attended each token (queries at stream indices stream .. now - 1)."""
        return scores / (now - stream).clamp_min(1) if self.average else scores

    # -- decode: choose the victim before attention ---------------------------------------------------------------
    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
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
        self.scores.scatter_(2, dest, 0.0)
        self.stream.scatter_(2, dest, seen_before + placement.src)
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
    def aggregate(self, column_scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """[B, Hq, kv] -> [B, Hkv, kv] over the query heads of each KV group."""
        batch, q_heads, kv = column_scores.shape
        grouped = column_scores.view(batch, kv_heads, q_heads // kv_heads, kv)
        if self.aggregation == "sum":
            return grouped.sum(2)
        if self.aggregation == "mean":
            return grouped.mean(2)
        return grouped.amax(2)

    def observe(self, view, column_scores: torch.Tensor) -> None:
        scores = self.aggregate(column_scores, self.scores.shape[1])
        if view.pending is None:  # decode: the columns are the slots
            self.scores[..., : scores.shape[-1]] += scores
            return
        used = view.used
        self.scores[..., :used] += scores[..., :used]
        real, seen_before = view.pending.real, view.pending.seen_before
        placement = self._select(view, real, seen_before, scores[..., used:])
        view.commit(placement)
        dest = torch.where(placement.dest >= 0, placement.dest, view.trash_slot)
        self.scores.scatter_(2, dest, scores[..., used:])

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

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.scores is not None:
            self.scores, self.stream = fn(self.scores), fn(self.stream)
        if self.arrived_keys is not None:
            self.arrived_keys = fn(self.arrived_keys)

    def reset(self) -> None:
        self.scores = self.stream = self.arrived_keys = None
        if isinstance(self.heavy_spec, float) or isinstance(self.recent_spec, float):
            self.heavy = self.recent = self.capacity = None

    def nbytes(self) -> int:
        tensors = (self.scores, self.stream, self.arrived_keys)
        return sum(t.nbytes for t in tensors if t is not None)


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mix32(x):
    """A 32-bit integer finaliser (xorshift-multiply, as in splitmix/murmur) on int64 tensors or Python ints holding
    values in [0, 2**32). The multipliers are below 2**31, so no product overflows int64 (exact everywhere)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _MASK32
    return x ^ (x >> 16)


def random_keys(seed: int, rows: torch.Tensor, heads: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """Uniform float32 keys in [0, 1), a pure function of (seed, batch row, global KV head, stream index): counter
    based, so any token's key can be recomputed anywhere (every TP rank, any device, inside torch.compile) with
    tensor ops only. `rows`, `heads`, `stream` are int64 tensors broadcasting to the output shape."""
    h = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    for part in (rows, heads, stream):
        h = _mix32(((h ^ (part & _MASK32)) + _GOLDEN32) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / 2**24)  # 24 bits: exact in float32


class RandomEvictionPolicy(HeavyHitterPolicy):
    """The baseline H2O is measured against: the recent window plus a uniformly random subset of older tokens.

    Each token gets a random key when it arrives, and the token with the lowest key is evicted, which picks
    uniformly among the candidates. No attention scores are needed. The key is a hash of (seed, batch row, global
    KV head, stream index) (`random_keys`): the same seed makes the same choices, and under tensor parallelism rank
    r's heads (global heads from `tensor_parallel.head_offset`) make exactly the choices one process makes for them.
    No generator state: it compiles and runs on any device."""

    deferred = False
    needs_attention = False

    def __init__(self, heavy, recent, seed: int = 0, tensor_parallel: TensorParallel = SINGLE_PROCESS):
        super().__init__(heavy, recent)
        self.seed, self.tensor_parallel = seed, tensor_parallel
        self.head_offset = 0

    def allocate(self, batch: int, heads: int, device) -> None:
        super().allocate(batch, heads, device)
        self.head_offset = self.tensor_parallel.head_offset(heads)

    def _random(self, stream: torch.Tensor) -> torch.Tensor:
        """Keys of the tokens with stream indices `stream` [B, H, n] (rows and heads by position in the tensor)."""
        batch, heads, _ = stream.shape
        rows = torch.arange(batch, device=stream.device)[:, None, None]
        global_heads = (torch.arange(heads, device=stream.device) + self.head_offset)[None, :, None]
        return random_keys(self.seed, rows, global_heads, stream)

    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        if real.shape[1] == 1 and seen > 0:
            return super().place(view, real, seen)
        batch, q = real.shape
        stream = (seen + torch.arange(q, device=real.device)).expand(batch, self.scores.shape[1], q)
        return self._select(view, real, seen, self._random(stream))

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        super().after_write(view, placement, keys, dest, positions, seen_before)
        self.scores.scatter_(2, dest, self._random(seen_before + placement.src))

    def observe(self, view, column_scores: torch.Tensor) -> None:  # never called: needs_attention is False
        raise RuntimeError("RandomEvictionPolicy does not use attention scores")
