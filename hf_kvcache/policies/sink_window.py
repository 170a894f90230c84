"""StreamingLLM: the first `sinks` real tokens of each row plus a window of the last `window` tokens.

Layout: slots [0, sinks) hold each row's first real tokens; slots [sinks, sinks + window) are a ring indexed by
the token's index in the (padded) stream, so all rows share it and an unpadded stream is laid out exactly like a
DynamicCache until the ring wraps. Padding tokens and tokens that went to a sink slot leave their ring slot invalid.

Positions: with a `rotator` ("positions inside the cache"), sink keys are re-rotated before each read to sit just
before the oldest window token, as StreamingLLM does; window keys keep their true distance to the (absolute) query
position, so they need no change. Without it, sinks keep their original positions.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..rope import KeyRotator
from .base import Placement, Policy


def reposition_sinks(layer, rotator: KeyRotator, sink_keys, sink_pos, sinks: int, used: int) -> None:
    """Re-rotate the sink keys (slots [0, sinks)) from their original copy so they sit just before the oldest
    valid token of the other slots [sinks, used); rows with no such token keep their original positions."""
    valid = layer.slot_valid[:, 0, sinks:used]
    positions = layer.slot_pos[:, 0, sinks:used]
    oldest = torch.where(valid, positions, torch.iinfo(torch.long).max).amin(-1)  # [B]
    target = oldest[:, None] - sinks + torch.arange(sinks, device=oldest.device)
    original = sink_pos[:, :sinks]
    target = torch.where(valid.any(-1, keepdim=True), target, original)
    layer.store.write_keys_slice(0, rotator.rotate(sink_keys[:, :, :sinks], target - original))


class SinkWindowPolicy(Policy):
    def __init__(self, sinks: int, window: int, rotator: KeyRotator | None = None):
        self.sinks, self.window, self.rotator = sinks, window, rotator
        self.capacity = sinks + window
        self.n_real: torch.Tensor | None = None  # [B] real tokens seen per row
        self.sink_keys: torch.Tensor | None = None  # [B, H, sinks + 1, D] sink keys as they arrived (+1 trash)
        self.sink_pos: torch.Tensor | None = None  # [B, sinks + 1] their original position ids
        self.sink_index: torch.Tensor | None = None  # [B, sinks + 1] their stream index (for crop)

    def allocate(self, batch: int, heads: int, device) -> None:
        self.n_real = torch.zeros(batch, dtype=torch.long, device=device)
        self.sink_pos = torch.zeros(batch, self.sinks + 1, dtype=torch.long, device=device)
        self.sink_index = torch.zeros_like(self.sink_pos)

    def place(self, layer, real: torch.Tensor, seen: int) -> Placement:
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

    def after_write(self, layer, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        if self.sinks == 0:
            return
        is_sink = placement.valid[:, 0] & (dest[:, 0] < self.sinks)  # [B, n]
        sink_slot = torch.where(is_sink, dest[:, 0], self.sinks)
        src = placement.src[:, 0]
        self.sink_pos.scatter_(1, sink_slot, positions.gather(1, src))
        self.sink_index.scatter_(1, sink_slot, seen_before + src)
        if self.rotator is not None:
            if self.sink_keys is None:
                b, h, _, d = keys.shape
                self.sink_keys = keys.new_zeros(b, h, self.sinks + 1, d)
            index = sink_slot[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            self.sink_keys.scatter_(2, index, keys)

    def decode_slot(self, layer, seen: int) -> int | None:
        self.n_real += 1
        if seen < self.sinks:
            return seen
        return self.sinks + (seen - self.sinks) % self.window

    def after_decode_write(self, layer, slot: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        if slot < self.sinks:
            self.sink_pos[:, slot] = positions[:, 0]
            self.sink_index[:, slot] = layer.seen
            if self.rotator is not None:
                if self.sink_keys is None:
                    b, h, _, d = keys.shape
                    self.sink_keys = keys.new_zeros(b, h, self.sinks + 1, d)
                self.sink_keys[:, :, slot] = keys[:, :, 0]

    def before_read(self, layer) -> None:
        if self.rotator is None or self.sinks == 0 or not self.has_evicted(layer.seen):
            return
        if layer.forward_info.has_padding:
            reposition_sinks(layer, self.rotator, self.sink_keys, self.sink_pos, self.sinks, layer.used)
            return
        # Unpadded rows share the ring layout: the oldest window token is in a known slot.
        oldest_slot = self.sinks + (layer.seen - self.window - self.sinks) % self.window
        oldest = layer.slot_pos[:, 0, oldest_slot]
        target = oldest[:, None] - self.sinks + torch.arange(self.sinks, device=oldest.device)
        delta = target - self.sink_pos[:, : self.sinks]
        layer.store.write_keys_slice(0, self.rotator.rotate(self.sink_keys[:, :, : self.sinks], delta))

    def used_after(self, seen: int) -> int:
        return min(seen, self.capacity)

    def has_evicted(self, seen: int) -> bool:
        return seen > self.capacity

    def crop(self, layer, new_seen: int) -> None:
        s = self.sinks
        drop_sink = self.sink_index[:, :s] >= new_seen
        layer.slot_valid[:, 0, :s] &= ~drop_sink
        layer.slot_valid[:, 0, max(s, new_seen) :] = False
        self.n_real = layer.slot_valid[:, 0, : self.capacity].long().sum(-1)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.n_real is None:
            return
        self.n_real, self.sink_pos, self.sink_index = fn(self.n_real), fn(self.sink_pos), fn(self.sink_index)
        if self.sink_keys is not None:
            self.sink_keys = fn(self.sink_keys)

    def reset(self) -> None:
        self.n_real = self.sink_keys = self.sink_pos = self.sink_index = None

    def nbytes(self) -> int:
        tensors = (self.n_real, self.sink_keys, self.sink_pos, self.sink_index)
        return sum(t.nbytes for t in tensors if t is not None)
