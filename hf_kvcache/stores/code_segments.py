"""Attention straight from the codes of a `QuantizedStore` (hf_kvcache.stores.quantized): its slots as
`hf_kvcache.kernels.QuantizedKV` runs (the quantized slots, then the append-only layout's full-precision residual),
views of the codes with no dequantization and no workspace, for the kernels of hf_kvcache.kernels.

`CodeSegments` is a mixin of `QuantizedStore`: it holds `segments`; the store keeps the codecs and state it reads
(`keys_codec`/`values_codec`, `joint`, `fp_k`/`fp_v`, `key_mean`, `key_smoothing`, `append_only`, `ring`) and
`_quantized_slots`, shared with `read`. The ring layout (hf_kvcache.stores.ring_layout) is not read this way.
"""

from __future__ import annotations


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
