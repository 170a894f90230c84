"""The growing append-only layout of `QuantizedStore` (hf_kvcache.stores.quantized, `append_only=True`; with fixed
slots too when there is no ring, where nothing grows and a write past the maximum length raises): tokens are appended
in order, the most recent `residual` (+ up to `flush - 1`) kept in full precision and the older ones quantized `flush`
at a time (whole blocks for per-channel keys, KIVI), each quantized once: an append costs O(new tokens).

Physical buffers grow by a small factor (`GROWTH`, 1/256), by at least `GROWTH_TOKENS` (8) tokens or one block, so
the bytes held stay within 0.4% (+ 8 tokens or one block) of the content. Amortised, a growth copies 256 tokens'
worth per appended token: small next to reading the whole cache at every decode step; the floor keeps a short cache
from reallocating at every step (below 2K tokens 1/256 is less than 8 tokens; a growth step also costs a decode step
its native FP8 write's single pass, since the inputs are checked before anything grows). A crop (`_truncate`)
forgets tokens from a length on; it cannot split a quantized block (`QuantizedStore.check_crop` refuses first).

`GrowingLayout` is a mixin of `QuantizedStore`: it holds the appends, crops and growth; the store keeps the state
they work on (`fp_k`/`fp_v`: the full-precision residual; `qlen`, `fp_len`, `residual`, `flush`, `growth`,
`fixed_slots`, the codecs) and the steps they call (`_encode_put`, `_codecs`, `check_crop`, `length`, `where`).
"""

from __future__ import annotations

import math

import torch

GROWTH = 1 / 256
GROWTH_TOKENS = 8


class GrowingLayout:
    def _reserve(self, tokens: int) -> None:
        """Physical capacity for `tokens` quantized tokens: exact at the first write, then +1/256, at least
        +GROWTH_TOKENS (amortised)."""
        cap = self.keys_codec.capacity
        if tokens <= cap:
            return
        if self.fixed_slots:
            raise ValueError(f"{self.where}: {tokens} tokens do not fit the fixed maximum length of {cap - 1}.")
        if cap:
            tokens = max(tokens, cap + max(self.flush, GROWTH_TOKENS, math.ceil(cap * self.growth)))
        tokens = -(-tokens // self.flush) * self.flush
        for codec in self._codecs():
            codec.resize(tokens)

    def _append(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens at positions [start, start + n) (a `start` before the end crops first): the oldest full-precision
        tokens that leave the residual, whole blocks of `flush`, are quantized; the rest stay in full precision."""
        if start != self.length:
            self._truncate(start)
        n = keys.shape[2]
        total = self.fp_len + n
        m = max(0, total - self.residual) // self.flush * self.flush  # tokens leaving full precision now
        a = min(m, self.fp_len)  # of which from the full-precision region (the oldest), then from the new tokens
        if m:
            if a and m - a:
                src_k = torch.cat((self.fp_k[:, :, :a], keys[:, :, : m - a]), 2)
                src_v = torch.cat((self.fp_v[:, :, :a], values[:, :, : m - a]), 2)
            elif a:
                src_k, src_v = self.fp_k[:, :, :a], self.fp_v[:, :, :a]
            else:
                src_k, src_v = keys[:, :, :m], values[:, :, :m]
            self._reserve(self.qlen + m)
            self._encode_put(src_k, src_v, start=self.qlen)
            self.qlen += m
        rest = self.fp_len - a
        if a and rest:
            self.fp_k[:, :, :rest] = self.fp_k[:, :, a : self.fp_len].clone()
            self.fp_v[:, :, :rest] = self.fp_v[:, :, a : self.fp_len].clone()
        keep = n - (m - a)
        if keep:
            self.fp_k[:, :, rest : rest + keep] = keys[:, :, m - a :]
            self.fp_v[:, :, rest : rest + keep] = values[:, :, m - a :]
        self.fp_len = rest + keep

    def _truncate(self, length: int) -> None:
        """Forget tokens from `length` on (the layer cropped them, e.g. assisted decoding)."""
        if length > self.length:
            raise RuntimeError(f"{self.where}: write at slot {length} leaves a gap after {self.length} tokens")
        self.check_crop(length)
        if length >= self.qlen:
            self.fp_len = length - self.qlen
        else:
            self.qlen, self.fp_len = length, 0
