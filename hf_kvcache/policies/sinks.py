"""Attention sinks' memory, shared by the policies that keep sinks (SinkWindowPolicy, CompositePolicy).

Sinks are each row's first real tokens. We remember, per sink slot, the key as it arrived, its original position
id and its stream index; with a rotator ("positions inside the cache", StreamingLLM), the sink keys are re-rotated
before each read, from the arrived copy (exact), to sit just before the oldest other kept token, with the layer's
own RoPE (none on NoPE layers, e.g. SmolLM3's or Cohere2's full-attention layers: the sinks then stay as stored).

When the store offers a writable full-precision view of the sink slots (`key_slots`, e.g. a CompositeCache's
full-precision sinks region), the rotation is written straight into it: the arrived keys' rotary pairs x = (x1 | x2)
and angles (-a | a) give x * cos + flip(x) * sin = (x1 cos a - x2 sin a | x2 cos a + x1 sin a), one multiply-add and
one strided copy. The same rotation as `KeyRotator.rotate` (float32 arithmetic, one rounding to the store's dtype)
in about a third of the operations; a decode step runs it in every layer. On CPU in eager code it is one native call
(hf_kvcache.kernels.cpu_rope) instead of those dozen ops: SmolLM2 at 8K, a sink cache 10.5 -> 7.2 ms per step above
the no-cache floor.
"""

from __future__ import annotations

import torch

from ..common.compile_static import StaticInt
from ..common.declared_state import DeclaredState
from ..common.rope import KeyRotator
from ..kernels.cpu_rope import rotate_sinks_into


class SinkMemory(DeclaredState):
    state = ("keys", "pos", "index", "_shift")
    sinks = StaticInt()  # torch.compile specialises on it (hf_kvcache.common.compile_static)

    def __init__(self, sinks: int, rotator: KeyRotator | None):
        self.sinks, self.rotator = sinks, rotator
        self.keys: torch.Tensor | None = None  # [B, H, sinks + 1, D] keys as they arrived (+1 trash)
        self.pos: torch.Tensor | None = None  # [B, sinks + 1] original position ids
        self.index: torch.Tensor | None = None  # [B, sinks + 1] stream indices (for crop)
        self._shift: torch.Tensor | None = None  # [B, 1, sinks] `_rotate_into`'s (i - sinks) - pos_i (_update_shift)

    def allocate(self, batch: int, device) -> None:
        self.pos = torch.zeros(batch, self.sinks + 1, dtype=torch.long, device=device)
        self.index = torch.zeros_like(self.pos)

    def _update_shift(self) -> None:
        """`_shift` [B, 1, sinks] = (i - sinks) - pos_i: what `_rotate_into` adds to the oldest position to get each
        sink's rotation, made when sinks are recorded, not per read."""
        s = self.sinks
        self._shift = torch.arange(-s, 0, device=self.pos.device) - self.pos[:, None, :s]

    def _ensure_keys(self, keys: torch.Tensor) -> None:
        if self.keys is None:
            b, h, _, d = keys.shape
            self.keys = keys.new_zeros(b, h, self.sinks + 1, d)

    def record(self, placement, keys: torch.Tensor, dest: torch.Tensor, positions, seen_before: int) -> None:
        """After a write whose placement is the same for all heads: remember the tokens that went to sink slots."""
        if self.sinks == 0:
            return
        is_sink = placement.valid[:, 0] & (dest[:, 0] < self.sinks)  # [B, n]
        sink_slot = torch.where(is_sink, dest[:, 0], self.sinks)
        src = placement.src[:, 0]
        self.pos.scatter_(1, sink_slot, positions.gather(1, src))
        self.index.scatter_(1, sink_slot, seen_before + src)
        self._update_shift()
        if self.rotator is not None:
            self._ensure_keys(keys)
            index = sink_slot[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            self.keys.scatter_(2, index, keys)

    def record_one(self, slot: int, keys: torch.Tensor, positions: torch.Tensor, stream_index: int) -> None:
        """A fast-path decode write of one unpadded token into sink `slot`."""
        self.pos[:, slot] = positions[:, 0]
        self.index[:, slot] = stream_index
        self._update_shift()
        if self.rotator is not None:
            self._ensure_keys(keys)
            self.keys[:, :, slot] = keys[:, :, 0]

    def reposition_before(self, view, oldest: torch.Tensor, has_other: torch.Tensor | None = None) -> None:
        """Rotate the sinks to sit just before position `oldest`: [B] (the same token set in every head) or
        [B, Hm] (per row and meta head; Hm is 1 or the layer's KV heads). Where `has_other` (same shape) is False
        the sinks keep their original positions. On a layer without RoPE (the rotator's identity) the keys carry no
        position: nothing to do."""
        if not self.rotator.applies(view.layer_idx):
            return
        s = self.sinks
        if oldest.dim() == 1:
            oldest = oldest[:, None]
            has_other = None if has_other is None else has_other[:, None]
        slots = view.key_slots(0, s)
        if slots is not None:
            self._rotate_into(slots, view.layer_idx, oldest, has_other)
            return
        original = self.pos[:, None, :s]  # [B, 1, s]
        target = oldest[..., None] - s + torch.arange(s, device=oldest.device)  # [B, Hm, s]
        if has_other is not None:
            target = torch.where(has_other[..., None], target, original)
        delta = target - original  # [B, Hm, s]: rotate broadcasts Hm = 1 over the KV heads
        view.write_keys(0, self.rotator.rotate(self.keys[:, :, :s], delta, view.layer_idx))

    def _rotate_into(self, slots: torch.Tensor, layer_idx: int, oldest: torch.Tensor, has_other) -> None:
        """`reposition_before` writing into `slots` [B, H, s, D], the store's sink key slots (full precision). With x
        the rotary pairs (x1 | x2) of the arrived keys and angles (-a | a): x * cos + flip(x) * sin is
        (x1 cos a - x2 sin a | x2 cos a + x1 sin a), the rotation of `KeyRotator.rotate`, in float32."""
        plan = self.rotator.plan(layer_idx)
        s, r = self.sinks, plan.rotary_dim
        if self._shift is None:  # (sinks set by hand, or a state file from before `_shift` existed)
            self._update_shift()
        if rotate_sinks_into(self.keys, slots, oldest, self._shift, has_other, plan.inv_freq, plan.convention):
            return  # (CPU, eager: one native call, hf_kvcache.kernels.cpu_rope)
        signed_freq = self.rotator.signed_frequencies(layer_idx, oldest.device)
        batch, hm = oldest.shape
        delta = oldest.view(batch, hm, 1) + self._shift  # [B, Hm, s]: sink i to just before `oldest`
        if has_other is not None:  # no other token kept: the sinks keep their original positions (delta 0)
            delta = delta * has_other.view(batch, hm, 1)
        angle = delta.view(batch, hm, s, 1, 1) * signed_freq  # [B, Hm, s, 2, r/2] float32 (Hm = 1: every head)
        keys, target = self.keys[:, :, :s], slots
        if r < slots.shape[-1]:  # partial RoPE: only the first r dims rotate
            keys, target = keys[..., :r], target[..., :r]
        x = _rotary_pairs(keys, plan.convention).float()
        _rotary_pairs(target, plan.convention).copy_(torch.addcmul(x * angle.cos(), x.flip(-2), angle.sin()))

    def reposition(self, view, used: int) -> None:
        """General case: find the oldest valid token among slots [sinks, used) per row and meta head (per-head
        policies such as a composite with heavy hitters keep different tokens in each KV head)."""
        if self.rotator is None or self.sinks == 0 or self.keys is None:
            return
        end = max(used, self.sinks + 1)  # at least one column: after a crop to nothing `used` is 0 (all invalid)
        valid = view.valid[:, :, self.sinks : end]  # [B, Hm, n]
        positions = view.positions[:, :, self.sinks : end]
        none = torch.iinfo(positions.dtype).max  # (no valid token: a row or head holding only sinks)
        oldest = torch.where(valid, positions, none).amin(-1)  # [B, Hm]
        self.reposition_before(view, oldest, oldest != none)

    def kept_after_crop(self, new_seen: int) -> torch.Tensor:
        """[B, sinks] whether each sink slot's token survives a crop to `new_seen` tokens."""
        return self.index[:, : self.sinks] < new_seen


def _rotary_pairs(keys: torch.Tensor, convention: str) -> torch.Tensor:
    """The rotary dims of keys [..., r] as a view [..., 2, r/2]: (x1 | x2) of each pair, for RoPE's "half"
    convention (pairs j, j + r/2) or "interleaved" (pairs 2j, 2j + 1)."""
    if convention == "interleaved":
        return keys.unflatten(-1, (keys.shape[-1] // 2, 2)).transpose(-1, -2)
    return keys.unflatten(-1, (2, keys.shape[-1] // 2))
