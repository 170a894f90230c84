"""The ring layout of `QuantizedStore` (hf_kvcache.stores.quantized): fixed slots (a cache's `max_length`, for
torch.compile) with a full-precision residual or blocks of tokens (KIVI).

Codes for the blocks that can ever leave the residual, plus one trash block; the full-precision tokens in a ring of
`residual + flush` slots (token p in ring slot p % size). Each decode step writes its token into the ring and
quantizes the one block that may have just completed, read from the ring, into its block of codes, or into the trash
block when none did (a masked write: same ops either way). Reads dequantize all code blocks, then copy the ring's
tokens not yet quantized over their columns (the others into a trash column). Positions come from a device counter
(`filled`), so nothing in decode depends on the stream length on the host. Tokens, codes and reads equal the growing
layout's (dynamic key means and warm-up FP8 scales are taken from the first write, the whole prompt, instead of the
first quantized block).

`RingLayout` is a mixin of `QuantizedStore`, used when its `ring` flag is set (fixed slots, append-only, and a
residual or blocks of tokens). It holds the ring's allocation, writes, crops and reads; the store keeps the state
they work on (`fp_k`/`fp_v`: the ring; `filled`, `qlen`, `fp_len`, `residual`, `flush`, `slots`, `code_blocks`) and
the codec steps they call (`_encode_put`, `_decode_codes`, `_smooth`, `_codecs`, `check_crop`, `length`, `where`).
"""

from __future__ import annotations

import torch

from .quantization import check_finite


class RingLayout:
    def _allocate_ring(self, slots: int, device) -> tuple[int, int]:
        """The code capacity (the blocks that can leave the residual within `slots - 1` tokens, the layer's capacity,
        + the trash block) and the ring's size (`residual + flush`: one more than the growing layout's residual
        buffer, as the ring still holds a completed block's first token when the new token arrives); allocates the
        device counter of tokens written."""
        self.code_blocks = max(0, slots - 1 - self.residual) // self.flush
        self.filled = torch.zeros(1, dtype=torch.long, device=device)
        return (self.code_blocks + 1) * self.flush, self.residual + self.flush

    def _check_ring_crop(self, length: int) -> None:
        """`check_crop` of the ring layout: tokens that become full precision again must still be in the ring."""
        settled = self._settled(length)
        if settled < self.length - self.fp_k.shape[2]:
            raise NotImplementedError(
                f"{self.where}: cannot crop {self.length} tokens to {length}: tokens from {settled} on would be "
                f"full precision again, but the ring keeps only the last {self.fp_k.shape[2]}. Keep `residual` at "
                "least as large as the number of tokens a crop may remove."
            )

    def _settled(self, length):
        """Tokens quantized once `length` tokens are written (host ints; SymInts under torch.compile, no guard)."""
        return torch.sym_max(0, length - self.residual) // self.flush * self.flush

    def _append_ring(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens at positions [start, start + n) known on the host (prefill, chunks): the blocks they complete are
        quantized (older tokens from the ring), the last of them go into the ring."""
        if start != self.length:
            self._truncate_ring(start)
        n, end = keys.shape[2], start + keys.shape[2]
        if end > self.slots - 1:
            raise ValueError(f"{self.where}: {end} tokens do not fit the fixed maximum length of {self.slots - 1}.")
        if self.length == 0:
            self._warm_up(keys, values)
        size = self.fp_k.shape[2]
        settled = self._settled(end)
        if settled > self.qlen:  # qlen <= start: the tokens before `start` come from the ring, the rest are new
            old = torch.arange(self.qlen, min(settled, start), device=keys.device) % size
            new = max(0, settled - start)
            src_k = torch.cat((self.fp_k.index_select(2, old), keys[:, :, :new]), 2)
            src_v = torch.cat((self.fp_v.index_select(2, old), values[:, :, :new]), 2)
            self._encode_put(src_k, src_v, start=self.qlen)
        tail = min(n, size)
        ring = torch.arange(end - tail, end, device=keys.device) % size
        self.fp_k.index_copy_(2, ring, keys[:, :, n - tail :].to(self.fp_k.dtype))
        self.fp_v.index_copy_(2, ring, values[:, :, n - tail :].to(self.fp_v.dtype))
        self.qlen, self.fp_len = settled, end - settled
        self.filled.fill_(end)

    def _warm_up(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Parameters the growing layout takes from its first quantized block (a dynamic key mean, warm-up FP8
        tensor/head scales) come from the first write here: decode steps quantize a block at every step, the trash
        block included, and must find them set."""
        keys = self._smooth(keys)
        for codec, x in zip(self._codecs(), (keys, values)):
            if getattr(codec, "scale", True) is None and codec.spec.granularity in ("tensor", "head"):
                codec.encode(x)

    def _write_ring_token(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None
    ) -> None:
        """A decode step: the token into the ring, then the block that completed now (if any) quantized into its
        codes, else the same work into the trash block. `index` ([1] long, = slot) carries the position on the
        device; `slot` is only used on the host outside torch.compile (to notice a crop)."""
        check_finite(keys, values, self.where)
        if index is None:
            index = torch.full((1,), slot, dtype=torch.long, device=self.device)
        if not torch.compiler.is_compiling() and slot != self.length:
            self._truncate_ring(slot)  # (compiled decode never crops: no host comparison to guard on)
        size, block_tokens = self.fp_k.shape[2], self.flush
        ring = index % size
        self.fp_k.index_copy_(2, ring, keys.to(self.fp_k.dtype))
        self.fp_v.index_copy_(2, ring, values.to(self.fp_v.dtype))
        end = index + 1 - self.residual  # the block that may have completed ends here (exclusive)
        complete = (end >= block_tokens) & (end % block_tokens == 0)
        block = torch.where(complete, end // block_tokens - 1, self.code_blocks)
        members = (end - block_tokens + torch.arange(block_tokens, device=index.device)) % size
        self._encode_put(self.fp_k.index_select(2, members), self.fp_v.index_select(2, members), block=block)
        self.filled.copy_(index + 1)
        self.qlen = self._settled(slot + 1)
        self.fp_len = slot + 1 - self.qlen

    def _truncate_ring(self, length: int) -> None:
        """Forget tokens from `length` on (a crop): possible while the tokens that become full precision again are
        still in the ring."""
        if length > self.length:
            raise RuntimeError(f"{self.where}: write at slot {length} leaves a gap after {self.length} tokens")
        self.check_crop(length)
        settled = self._settled(length)
        self.qlen, self.fp_len = settled, length - settled
        self.filled.fill_(length)

    def _read_ring(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` of the ring layout: every code block dequantized, then the ring's tokens that are not quantized yet
        copied over their columns (the others into a trash column past `used`). Same ops at every decode step."""
        if not torch.compiler.is_compiling() and used < self.length:
            self._truncate_ring(used)
        codes = self.code_blocks * self.flush
        width = max(used, codes) + 1
        out_k, out_v = self._decode_codes(width, codes)
        out_k[:, :, codes:].zero_()  # columns no code covers: finite (masked) or overwritten from the ring below
        out_v[:, :, codes:].zero_()
        size = self.fp_k.shape[2]
        last = self.filled - 1
        position = last - (last - torch.arange(size, device=self.device)) % size  # the token in each ring slot
        settled = (self.filled - self.residual).clamp(min=0) // self.flush * self.flush
        fresh = (position >= settled) & (position >= 0) & (position < used)
        target = torch.where(fresh, position, width - 1)
        out_k.index_copy_(2, target, self.fp_k)
        out_v.index_copy_(2, target, self.fp_v)
        return out_k[:, :, :used], out_v[:, :, :used]
