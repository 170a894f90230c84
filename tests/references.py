"""Deliberately simple references of every cache's policy, over the full key/value history (tests/test_properties.py).

A `Reference` keeps every token of every batch row: its index in the (left-padded) stream, its position id, whether
it is real or padding, its key before RoPE and its value, per KV head. A rule object decides, with plain Python over
that history, which tokens a cache must hold per row and KV head, at which position their keys must sit, and how
far the stored keys and values may be from the originals (their precision):

- `SinkWindowRule` (SinkCache, SlidingWindowCache, CompositeCache with sinks + windows and nothing older): the first
  `sinks` real tokens of the row plus the real tokens among the last `window` stream indices.
- `KeepAllRule` (QuantizedFP8Cache, KIVICache, CompositeCache ending in "rest"): every real token.
- `HeavyHitterRule` (H2OCache, RandomEvictionCache): the `recent` newest stream indices plus, while there are more
  real tokens than `heavy + recent`, the older ones with the highest score. H2O's score is the attention a token
  received, accumulated over forwards (the test feeds the same synthetic attention to cache and reference); random
  eviction's score is a hash of (seed, row, KV head, stream index) drawn once when the token arrives. A multi-token
  forward adds its scores first and then keeps the top tokens; a one-token step evicts the lowest-scoring old token
  by the scores so far, then adds the step's scores.
- `CompositeRule` (CompositeCache): sinks, then windows by age (tokens back from the newest), then the final region:
  nothing (evict), everything (keep), or the `heavy` highest-scoring older tokens (H2O over tokens that aged out).

Positions: original, or "moved" as the caches document: sinks re-rotated to sit just before the oldest other kept
token of the row (StreamingLLM), or every kept token of a row and head re-placed at contiguous positions ending at
the newest (H2O "compact").

Precision: `full` (the stored value equals the original up to float rounding of a re-rotation), FP8 E4M3 with one
scale per token and KV head (|error| <= 2^-4 |x| + 2^-9 * scale, scale = amax / 448 rounded up to bfloat16: half a
unit in the last place of normal and subnormal FP8 numbers), and KIVI's asymmetric integers (|error| <= half a step,
step = (max - min) / (2^bits - 1) over the quantization group: channels over blocks of `group_size` tokens for keys,
groups of `value_group_size` channels of a token for values). Which tokens are quantized follows the documented
full-precision residual: the newest `residual` tokens (plus an incomplete block) stay in full precision; quantized
tokens never come back to full precision.

Batch operations act on rows as wholes (beam reorder, repeat-interleave, select); `crop` forgets the newest stream
indices and is refused (ValueError) once a token was evicted; `reset` forgets everything.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from hf_kvcache.scorers.random_keys import random_keys

FP8_E4M3_MAX = 448.0


@dataclass(eq=False)
class Token:
    stream: int  # index in the row's stream (padding included)
    position: int  # position id
    real: bool
    raw_key: torch.Tensor  # [H, D] before RoPE
    value: torch.Tensor  # [H, D]
    #: CompositeRule: per KV head, [region it was last stored in, how many times it was quantized (each move into a
    #: quantized region quantizes the values it held again)]
    regions: dict[int, list] = field(default_factory=dict)


@dataclass
class Row:
    tokens: list[Token] = field(default_factory=list)
    #: per KV head, stream indices of the tokens a stateful rule keeps (heavy hitters)
    kept: list[set[int]] = field(default_factory=list)
    #: per KV head, stream index -> score (float32 scalar tensors, added in the cache's order)
    scores: list[dict[int, torch.Tensor]] = field(default_factory=list)


# -- precisions ---------------------------------------------------------------------------------------------------
def fp8_token_tolerance(x: torch.Tensor) -> torch.Tensor:
    """x [n, D] (one scale per row of D values): the largest FP8 E4M3 rounding error of each value."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / FP8_E4M3_MAX * (1 + 2**-7)  # rounded up to bfloat16 (8 significant bits)
    return x.abs() * 2**-4 + scale * 2**-9 + 1e-7


def int_group_tolerance(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Half a quantization step of asymmetric min-max integers over `dim` of x (one group), broadcast to x."""
    step = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / (2**bits - 1)
    return (step * 0.5 * (1 + 1e-3) + 1e-6).expand_as(x)


class Reference:
    """Full history of every row plus a rule (see the module docstring)."""

    def __init__(self, rule, heads: int, rope):
        self.rule, self.heads, self.rope = rule, heads, rope
        self.rows: list[Row] = []
        self.seen = 0
        self.evicted_any = False

    # -- the stream ------------------------------------------------------------------------------------------------
    def forward(self, raw_keys, values, real, positions, attention=None) -> None:
        """raw_keys, values [B, H, q, D]; real, positions [B, q]; attention(b, h, position) -> float32 scalar: the
        synthetic attention of this forward (for rules that score by attention)."""
        batch, _, q, _ = raw_keys.shape
        if not self.rows:
            self.rows = [
                Row(kept=[set() for _ in range(self.heads)], scores=[{} for _ in range(self.heads)])
                for _ in range(batch)
            ]
        for b, row in enumerate(self.rows):
            new = [
                Token(
                    self.seen + i,
                    int(positions[b, i]),
                    bool(real[b, i]),
                    raw_keys[b, :, i].clone(),
                    values[b, :, i].clone(),
                )
                for i in range(q)
            ]
            row.tokens += new
            self.rule.step(self, b, row, new, attention)
        self.seen += q
        self.rule.after_forward(self)
        if self.rule.has_evicted(self):
            self.evicted_any = True

    def crop_splits_quantized_block(self, remove: int) -> bool:
        prefix = getattr(getattr(self.rule, "precision", None), "prefix", None)
        return prefix is not None and prefix.splits_block(max(self.seen - remove, 0))

    def crop(self, remove: int) -> None:
        """Forget the newest `remove` stream indices; a ValueError once a token was evicted (it cannot come back)."""
        if self.evicted_any:
            raise ValueError("cannot crop after an eviction")
        new_seen = max(self.seen - remove, 0)
        for row in self.rows:
            row.tokens = [t for t in row.tokens if t.stream < new_seen]
            row.kept = [{s for s in kept if s < new_seen} for kept in row.kept]
            row.scores = [{s: v for s, v in scores.items() if s < new_seen} for scores in row.scores]
        self.seen = new_seen
        self.rule.after_crop(self)

    def reset(self) -> None:
        self.rows, self.seen, self.evicted_any = [], 0, False
        self.rule.after_reset()

    def select(self, indices: list[int]) -> None:
        """Rows in this order (beam reorder, batch_select_indices, repeat_interleave): copies, not aliases."""
        self.rows = [copy.deepcopy(self.rows[i]) for i in indices]

    # -- what the cache must hold -------------------------------------------------------------------------------------
    def kept(self, b: int, h: int) -> list[Token]:
        """Tokens row b, KV head h must hold, oldest first."""
        row = self.rows[b]
        streams = self.rule.kept_streams(self, row, h)
        return [t for t in row.tokens if t.stream in streams and t.real]

    def target_positions(self, b: int, h: int, kept: list[Token]) -> list[int]:
        return self.rule.positions(self, self.rows[b], h, kept)

    def expected(self, b: int, h: int, key_rotation: torch.Tensor | None = None):
        """(kept tokens, positions of their keys, keys rotated there [n, D], values [n, D], key tolerance [n, D],
        value tolerance [n, D]). `key_rotation` [D, D]: the cache stores keys @ key_rotation (quantized caches'
        outlier rotation): the keys and their tolerances are given in that basis."""
        kept = self.kept(b, h)
        pos = self.target_positions(b, h, kept)
        if not kept:
            empty = torch.zeros(0, self.rope.head_dim)
            return kept, pos, empty, empty, empty, empty
        raw = torch.stack([t.raw_key[h] for t in kept])
        keys = self.rope.rotate(raw, torch.tensor(pos))
        if key_rotation is not None:
            keys = keys @ key_rotation
        values = torch.stack([t.value[h] for t in kept])
        key_tol, value_tol = self.rule.tolerances(self, self.rows[b], h, kept, keys, values)
        return kept, pos, keys, values, key_tol, value_tol


class Rope:
    """The model's RoPE (transformers' own rotary embedding and apply_rotary_pos_emb)."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        self.embedding = LlamaRotaryEmbedding(config)
        self.apply = apply_rotary_pos_emb
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, D] rotated at positions [n]."""
        positions = positions.reshape(1, -1)
        cos, sin = self.embedding(x, positions)  # [1, n, D]
        shape = x.shape
        flat = x.reshape(1, 1, -1, shape[-1])
        out, _ = self.apply(flat, flat, cos, sin)
        return out.reshape(shape)

    def rotate_batch(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, q, D] rotated at positions [B, q] (what attention hands the cache)."""
        cos, sin = self.embedding(x, positions)
        out, _ = self.apply(x, x, cos, sin)
        return out


# -- rules ----------------------------------------------------------------------------------------------------------
class _Rule:
    capacity: int | None = None

    def step(self, ref, b, row, new, attention) -> None:
        pass

    def after_forward(self, ref) -> None:
        pass

    def has_evicted(self, ref) -> bool:
        return self.capacity is not None and ref.seen > self.capacity

    def after_crop(self, ref) -> None:
        pass

    def after_reset(self) -> None:
        pass

    def positions(self, ref, row, h, kept) -> list[int]:
        return [t.position for t in kept]

    def tolerances(self, ref, row, h, kept, keys, values):
        full = torch.full_like(keys, 1e-5)
        return full, torch.full_like(values, 1e-6)


def sinks_and_window(ref, row, sinks: int, window: int) -> set[int]:
    """Stream indices of the first `sinks` real tokens and of the last `window` stream indices."""
    first = [t.stream for t in row.tokens if t.real][:sinks]
    return set(first) | set(range(max(0, ref.seen - window), ref.seen))


def sinks_before_oldest(kept, sinks: int, sink_streams: set[int]) -> list[int]:
    """StreamingLLM positions: sink i at (oldest other kept position) - sinks + i; original without other tokens."""
    others = [t.position for t in kept if t.stream not in sink_streams]
    if not others:
        return [t.position for t in kept]
    oldest = min(others)
    out, i = [], 0
    for t in kept:
        if t.stream in sink_streams:
            out.append(oldest - sinks + i)
            i += 1
        else:
            out.append(t.position)
    return out


class SinkWindowRule(_Rule):
    """First `sinks` real tokens + the last `window` stream indices; sinks moved before the window if `move_sinks`."""

    def __init__(self, sinks: int, window: int, move_sinks: bool):
        self.sinks, self.window, self.move_sinks = sinks, window, move_sinks
        self.capacity = sinks + window

    def kept_streams(self, ref, row, h) -> set[int]:
        return sinks_and_window(ref, row, self.sinks, self.window)

    def positions(self, ref, row, h, kept):
        if not self.move_sinks:
            return [t.position for t in kept]
        return sinks_before_oldest(kept, self.sinks, set([t.stream for t in row.tokens if t.real][: self.sinks]))


class KeepAllRule(_Rule):
    """Every real token; `precision(ref, row, h, kept, keys, values)` gives the tolerances."""

    def __init__(self, precision):
        self.precision = precision

    def kept_streams(self, ref, row, h) -> set[int]:
        return {t.stream for t in row.tokens}

    def has_evicted(self, ref) -> bool:
        return False

    def after_forward(self, ref) -> None:
        self.precision.prefix.after_forward(ref.seen)

    def after_crop(self, ref) -> None:
        self.precision.prefix.after_crop(ref.seen)

    def after_reset(self) -> None:
        self.precision.prefix.reset()

    def tolerances(self, ref, row, h, kept, keys, values):
        return self.precision.tolerances(ref, row, h, kept, keys, values)


class HeavyHitterRule(_Rule):
    """The `recent` newest stream indices + the highest-scoring older real tokens, `heavy + recent` in all."""

    def __init__(self, heavy: int, recent: int, compact: bool, random_seed: int | None = None):
        self.heavy, self.recent, self.compact, self.random_seed = heavy, recent, compact, random_seed
        self.capacity = heavy + recent

    def _score(self, b, h, token, attention):
        if self.random_seed is not None:
            return random_keys(self.random_seed, torch.tensor(b), torch.tensor(h), torch.tensor(token.stream))
        return attention(b, h, token.position) if token.real else torch.zeros((), dtype=torch.float32)

    def step(self, ref, b, row, new, attention) -> None:
        seen_after = ref.seen + len(new)
        by_stream = {t.stream: t for t in row.tokens}
        for h in range(ref.heads):
            kept, scores = row.kept[h], row.scores[h]
            if len(new) == 1 and ref.seen > 0:  # decode: evict by the scores so far, then add this step's
                token = new[0]
                if token.real:
                    real_kept = [s for s in kept if by_stream[s].real]
                    if len(real_kept) >= self.capacity:
                        old = [s for s in real_kept if s <= token.stream - self.recent]
                        victim = min(old, key=lambda s: (scores[s].item(), s))
                        kept.discard(victim)
                        scores.pop(victim)
                    kept.add(token.stream)
                    scores[token.stream] = torch.zeros((), dtype=torch.float32)
                if self.random_seed is None:
                    for s in kept:
                        scores[s] = scores[s] + self._score(b, h, by_stream[s], attention)
                elif token.real:
                    scores[token.stream] = self._score(b, h, token, attention)
                continue
            # a multi-token forward: score everything visible, then keep the recent window and the top rest
            for token in new:
                if token.real:
                    kept.add(token.stream)
                    scores[token.stream] = torch.zeros((), dtype=torch.float32)
            if self.random_seed is None:
                for s in kept:
                    scores[s] = scores[s] + self._score(b, h, by_stream[s], attention)
            else:
                for token in new:
                    if token.real:
                        scores[token.stream] = self._score(b, h, token, attention)
            if len(kept) > self.capacity:
                recent = {s for s in kept if s >= seen_after - self.recent}
                rest = sorted(kept - recent, key=lambda s: -scores[s].item())
                survivors = recent | set(rest[: self.capacity - len(recent)])
                for s in kept - survivors:
                    scores.pop(s)
                kept.intersection_update(survivors)

    def kept_streams(self, ref, row, h) -> set[int]:
        return row.kept[h]

    def positions(self, ref, row, h, kept):
        if not self.compact or not kept:
            return [t.position for t in kept]
        newest = max(t.position for t in kept)
        order = sorted(range(len(kept)), key=lambda i: kept[i].position)
        out = [0] * len(kept)
        for rank, i in enumerate(order):
            out[i] = newest - len(kept) + 1 + rank
        return out


class CompositeRule(_Rule):
    """CompositeCache: first `sinks` real tokens, windows by age covering the last `window` stream indices (each at
    its region's precision), then `final`: "evict", "keep" (every older real token) or "heavy" (the `heavy`
    highest-scoring real tokens among those that aged out of the windows)."""

    def __init__(
        self,
        sinks: int,
        windows: list[tuple[int, int, object]],
        final: str,
        heavy: int,
        final_precision,
        move_sinks: bool,
        sink_precision,
    ):
        self.sinks, self.windows, self.final, self.heavy = sinks, windows, final, heavy
        self.window = windows[-1][1]
        self.final_precision, self.move_sinks, self.sink_precision = final_precision, move_sinks, sink_precision
        self.capacity = None if final == "keep" else sinks + self.window + (heavy if final == "heavy" else 0)

    def _sink_streams(self, row) -> set[int]:
        return set([t.stream for t in row.tokens if t.real][: self.sinks])

    def step(self, ref, b, row, new, attention) -> None:
        if self.final != "heavy":
            return
        seen_after = ref.seen + len(new)
        sinks = self._sink_streams(row)
        by_stream = {t.stream: t for t in row.tokens}
        window_start = seen_after - self.window
        for h in range(ref.heads):
            kept, scores = row.kept[h], row.scores[h]
            for token in new:
                if token.real:
                    kept.add(token.stream)
                    scores[token.stream] = torch.zeros((), dtype=torch.float32)
            if len(new) > 1 or ref.seen == 0:  # chunk: scores first, then the heavy choice among the older tokens
                for s in kept:
                    scores[s] = scores[s] + attention(b, h, by_stream[s].position)
            older = sorted((s for s in kept if s < window_start and s not in sinks), key=lambda s: -scores[s].item())
            for s in older[self.heavy :]:
                kept.discard(s)
                scores.pop(s)
            if len(new) == 1 and ref.seen > 0:  # one token: the choice was made with the scores so far
                for s in kept:
                    scores[s] = scores[s] + attention(b, h, by_stream[s].position)

    def kept_streams(self, ref, row, h) -> set[int]:
        if self.final == "keep":
            return {t.stream for t in row.tokens}
        window = sinks_and_window(ref, row, self.sinks, self.window)
        if self.final == "heavy":
            return window | row.kept[h]
        return window

    def has_evicted(self, ref) -> bool:
        return self.final != "keep" and ref.seen > self.sinks + self.window + (
            self.heavy if self.final == "heavy" else 0
        )

    def positions(self, ref, row, h, kept):
        if not self.move_sinks or not self.sinks:
            return [t.position for t in kept]
        return sinks_before_oldest(kept, self.sinks, self._sink_streams(row))

    def after_forward(self, ref) -> None:
        """A token once stored quantized keeps that error, even if a crop makes it young again (full precision), and
        each move into a quantized region rounds again."""
        for b, row in enumerate(ref.rows):
            for h in range(ref.heads):
                for token in ref.kept(b, h):
                    region, precision = self.region_of(ref, row, token)
                    last = token.regions.setdefault(h, [None, 0])
                    if region != last[0]:
                        last[0] = region
                        last[1] += precision != "full"

    def after_crop(self, ref) -> None:
        self.after_forward(ref)

    def region_of(self, ref, row, token) -> tuple[str, str]:
        """(region name, its precision) of a kept token."""
        if token.stream in self._sink_streams(row):
            return "sinks", self.sink_precision
        age = ref.seen - 1 - token.stream
        for i, (start, end, precision) in enumerate(self.windows):
            if start <= age < end:
                return f"window {i}", precision
        return "final", self.final_precision

    def tolerances(self, ref, row, h, kept, keys, values):
        key_tol, value_tol = torch.full_like(keys, 1e-5), torch.full_like(values, 1e-6)
        for i, token in enumerate(kept):
            rounded = token.regions.get(h, [None, 0])[1]
            if rounded:  # each FP8 rounding adds at most its bound (of a value within 2^-4 of the original)
                key_tol[i] = fp8_token_tolerance(keys[i : i + 1])[0] * rounded * (1 + 2**-4)
                value_tol[i] = fp8_token_tolerance(values[i : i + 1])[0] * rounded * (1 + 2**-4)
        return key_tol, value_tol


# -- precisions of keep-all caches ------------------------------------------------------------------------------
class QuantizedPrefix:
    """Append-only quantized stores: tokens [0, quantized) are quantized, the rest are the full-precision residual.
    Tokens leave the residual in multiples of `flush` once more than `residual` wait; a crop keeps the count."""

    def __init__(self, residual: int, flush: int):
        self.residual, self.flush, self.count = residual, flush, 0

    def after_forward(self, seen: int) -> None:
        waiting = seen - self.count
        self.count += max(0, waiting - self.residual) // self.flush * self.flush

    def after_crop(self, seen: int) -> None:
        self.count = min(self.count, seen)

    def splits_block(self, seen: int) -> bool:
        """A crop to `seen` tokens would cut a quantized block: the caches refuse it (NotImplementedError "cannot
        crop to ..."), leaving everything as it was."""
        return seen < self.count and seen % self.flush != 0

    def reset(self) -> None:
        self.count = 0


class FP8TokenPrecision:
    """QuantizedFP8Cache(granularity="token"), E4M3 keys and values, one scale per token and KV head."""

    def __init__(self, residual: int):
        self.prefix = QuantizedPrefix(residual, 16 if residual else 1)

    def tolerances(self, ref, row, h, kept, keys, values):
        key_tol, value_tol = torch.full_like(keys, 1e-5), torch.full_like(values, 1e-6)
        quantized = torch.tensor([t.stream < self.prefix.count for t in kept])
        key_tol[quantized] = fp8_token_tolerance(keys[quantized])
        value_tol[quantized] = fp8_token_tolerance(values[quantized])
        return key_tol, value_tol


class KIVIPrecision:
    """KIVICache: keys per channel over blocks of `group_size` stream indices, values per token in groups of
    `value_group` channels, `bits`-bit asymmetric integers; residual in full precision."""

    def __init__(self, bits: int, group_size: int, value_group: int, residual: int):
        self.bits, self.group_size, self.value_group = bits, group_size, value_group
        self.prefix = QuantizedPrefix(residual, group_size)

    def tolerances(self, ref, row, h, kept, keys, values):
        key_tol, value_tol = torch.full_like(keys, 1e-5), torch.full_like(values, 1e-6)
        # key blocks over stream indices, padding tokens included (they are stored too)
        by_stream = {t.stream: t for t in row.tokens}
        block_keys = {}
        for start in range(0, self.prefix.count, self.group_size):
            members = [by_stream[s] for s in range(start, start + self.group_size)]
            raw = torch.stack([m.raw_key[h] for m in members])
            block_keys[start] = ref.rope.rotate(raw, torch.tensor([m.position for m in members]))
        for i, token in enumerate(kept):
            if token.stream >= self.prefix.count:
                continue
            block = block_keys[token.stream // self.group_size * self.group_size]
            key_tol[i] = int_group_tolerance(block, self.bits, 0)[0]
            grouped = values[i].view(-1, self.value_group)
            value_tol[i] = int_group_tolerance(grouped, self.bits, -1).reshape(-1)
        return key_tol, value_tol
