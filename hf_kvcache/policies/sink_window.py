"""StreamingLLM: the first `sinks` real tokens of each row plus a window of the last `window` tokens.

Layout: slots [0, sinks) hold each row's first real tokens; slots [sinks, sinks + window) are a ring indexed by
the token's index in the (padded) stream, so all rows share it and an unpadded stream is laid out exactly like a
DynamicCache until the ring wraps. Padding tokens and tokens that went to a sink slot leave their ring slot invalid.

Positions: with a `rotator` ("positions inside the cache"), sink keys are re-rotated before each read to sit just
before the oldest window token, as StreamingLLM does; window keys keep their true distance to the (absolute) query
position, so they need no change. Without it, sinks keep their original positions.
"""

from __future__ import annotations

import torch

from ..common.compile_static import StaticInt
from ..common.rope import KeyRotator
from .base import Placement, Policy
from .sinks import SinkMemory


class SinkWindowPolicy(Policy):
    state, parts = ("n_real",), ("memory",)
    compileable = True
    sinks, window = StaticInt(), StaticInt()  # torch.compile specialises on them (hf_kvcache.common.compile_static)

    def __init__(self, sinks: int, window: int, rotator: KeyRotator | None = None):
        self.sinks, self.window, self.rotator = sinks, window, rotator
        self.capacity = sinks + window
        self.n_real: torch.Tensor | None = None  # [B] real tokens seen per row
        self.memory = SinkMemory(sinks, rotator)

    # the sinks' memory, under the names the tests and callers use
    sink_keys = property(lambda self: self.memory.keys)
    sink_pos = property(lambda self: self.memory.pos)
    sink_index = property(lambda self: self.memory.index)

    def allocate(self, batch: int, heads: int, device) -> None:
        self.n_real = torch.zeros(batch, dtype=torch.long, device=device)
        self.memory.allocate(batch, device)

    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        batch, q = real.shape
        device = real.device
        t = seen + torch.arange(q, device=device)  # stream index of each new token
        real_index = self.n_real[:, None] + real.long().cumsum(-1) - 1  # [B, q]
        self.n_real = self.n_real + real.long().sum(-1)

        is_sink = real & (real_index < self.sinks)
        sink_dest = torch.where(is_sink, real_index, -1)

        # Ring: only the last `window` tokens of this forward, and never the first `sinks` stream indices.
        in_ring = (t >= self.sinks) & (t >= seen + q - self.window)
        ring_slot = self.sinks + (t - self.sinks).remainder(self.window)
        ring_dest = torch.where(in_ring, ring_slot, -1).expand(batch, q)
        ring_valid = real & ~is_sink & in_ring

        src = torch.arange(q, device=device).expand(batch, q)
        return Placement(
            src=torch.cat((src, src), -1)[:, None],
            dest=torch.cat((sink_dest, ring_dest), -1)[:, None],
            valid=torch.cat((is_sink, ring_valid), -1)[:, None],
        )

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        self.memory.record(placement, keys, dest, positions, seen_before)

    def decode_slot(self, view, seen: int) -> int | None:
        self.n_real += 1
        if seen < self.sinks:
            return seen
        return self.sinks + (seen - self.sinks) % self.window

    def after_decode_write(self, view, slot: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        if slot < self.sinks:
            self.memory.record_one(slot, keys, positions, view.seen)

    def before_read(self, view) -> None:
        if self.rotator is None or self.sinks == 0 or not self.has_evicted(view.seen):
            return
        if view.padded:
            self.memory.reposition(view, view.used)
            return
        # Unpadded rows share the ring layout: the oldest window token is in a known slot.
        oldest_slot = self.sinks + (view.seen - self.window - self.sinks) % self.window
        index = torch.full((1,), oldest_slot, dtype=torch.long, device=view.positions.device)  # no Python index:
        self.memory.reposition_before(view, view.positions[:, 0].index_select(-1, index)[:, 0].long())  # compiles

    def used_after(self, seen: int) -> int:
        return min(seen, self.capacity)

    def has_evicted(self, seen: int) -> bool:
        return seen > self.capacity

    def crop(self, view, new_seen: int) -> None:
        s = self.sinks
        view.evict(self.memory.kept_after_crop(new_seen)[:, None])
        view.forget_from(max(s, new_seen))
        self.n_real = view.valid[:, 0, : self.capacity].long().sum(-1)
