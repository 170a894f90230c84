"""Attention straight from the codes of a `QuantizedStore` (hf_kvcache.stores.quantized): its slots as
`hf_kvcache.kernels.QuantizedKV` runs (the quantized slots, then the append-only layout's full-precision residual),
views of the codes with no dequantization and no workspace, for the kernels of hf_kvcache.kernels.

`CodeSegments` is a mixin of `QuantizedStore`: it holds `segments` (and `capacity_buffers` / `capacity_segments` /
`segment_lengths`: the same runs over whole buffers, for a reader that keeps them across decode steps); the store
keeps the codecs and state it reads (`keys_codec`/`values_codec`, `joint`, `fp_k`/`fp_v`, `key_mean`,
`key_smoothing`, `append_only`, `ring`) and `_quantized_slots`, shared with `read`. The ring layout
(hf_kvcache.stores.ring_layout) is not read this way.
"""

from __future__ import annotations

import math


class CodeSegments:
    def segments(self, used: int, stable: bool = False):
        """(key segments, value segments) of slots [0, used) as `hf_kvcache.kernels.QuantizedKV` runs, in slot order:
        the quantized slots, then (append-only layout) the full-precision residual. Views of the codes, no
        dequantization and no workspace; valid until the next write. `stable=True`: the segments survive the write of
        new tokens (a prefill chunk attends to the past as it was): the append-only layout copies only its residual
        (which writes shift in place; at most residual + flush tokens), the slot layout copies everything. Mirrors
        `read`."""
        from .code_views import QuantizedKV, from_codec

        if self.ring:
            raise NotImplementedError(
                f"{self.where}: attention from the codes does not read the fixed-length ring layout (a residual or "
                "blocks of tokens with `max_length`): its full-precision tokens sit in a ring, not after the codes; "
                "use attention='dequantize' (what 'auto' picks for it)."
            )
        quantized = self._quantized_slots(used)
        bias = None
        if self.key_smoothing and self.key_mean is not None:
            bias = self.key_mean.to(self.dtype).float()
        keys, values = [], []
        if quantized:
            if self.joint:
                keys.append(from_codec(self.keys_codec, quantized, slice(0, self.batch), bias))
                values.append(from_codec(self.keys_codec, quantized, slice(self.batch, 2 * self.batch)))
            else:
                keys.append(from_codec(self.keys_codec, quantized, None, bias))
                values.append(from_codec(self.values_codec, quantized))
            if stable and not self.append_only:  # slot layout: writes overwrite slots in place
                keys, values = [s.clone() for s in keys], [s.clone() for s in values]
        if used > quantized:
            rest_k, rest_v = self.fp_k[:, :, : used - quantized], self.fp_v[:, :, : used - quantized]
            if stable:
                rest_k, rest_v = rest_k.clone(), rest_v.clone()
            keys.append(QuantizedKV(rest_k, "none"))
            values.append(QuantizedKV(rest_v, "none"))
        return keys, values

    def capacity_buffers(self) -> tuple | None:
        """The tensors `capacity_segments` views, for a reader that keeps those runs across decode steps (the native
        CPU kernel's arguments): while the store holds the same objects (compared by identity) the runs stay valid
        and only how much of each is content changes (`segment_lengths`); a write that replaces a buffer (growth, a
        crop, a reset) changes them. None where a run would hold a tensor derived from the store's state (the
        smoothed keys' bias, a fixed FP8 scale) or for the ring layout: there, use `segments`."""
        codecs = self._codecs()
        if (
            self.ring
            or (self.key_smoothing and self.key_mean is not None)
            or any(c.spec.granularity not in ("token", "channel") for c in codecs)
        ):
            return None
        buffers = tuple(t for codec in codecs for t in codec.slot.values())
        return buffers if self.fp_k is None else buffers + (self.fp_k, self.fp_v)

    def capacity_segments(self):
        """(key segments, value segments): the runs `segments` returns, each over its buffers' whole capacity (call
        where `capacity_buffers` is not None)."""
        from .code_views import QuantizedKV, from_codec

        keys, values = [], []
        for codec in self._codecs():
            align = math.lcm(codec.block, codec.pack_block if getattr(codec, "token_pairs", False) else 1)
            whole = codec.capacity - codec.capacity % align
            if self.joint:
                keys.append(from_codec(codec, whole, slice(0, self.batch)))
                values.append(from_codec(codec, whole, slice(self.batch, 2 * self.batch)))
            else:
                (keys if codec is self.keys_codec else values).append(from_codec(codec, whole))
        if self.fp_k is not None:
            keys.append(QuantizedKV(self.fp_k, "none"))
            values.append(QuantizedKV(self.fp_v, "none"))
        return keys, values

    def segment_lengths(self, used: int) -> list[int]:
        """How many tokens of each run of `capacity_segments` slots [0, used) cover (the quantized slots, then the
        residual's)."""
        quantized = self._quantized_slots(used)
        return [quantized] if self.fp_k is None else [quantized, used - quantized]
