"""Reads of a `QuantizedStore` (hf_kvcache.stores.quantized) in the model's dtype: its slots dequantized into the
shared workspace (`read`), or selected slots into fresh tensors (`read_slots`).

`DequantizedReads` is a mixin of `QuantizedStore`, as `CodeSegments` is for reads straight from the codes: the store
keeps the codecs and state these read (`keys_codec` / `values_codec`, `joint`, `fp_k` / `fp_v`, `key_mean`,
`key_smoothing`, `append_only`, `fixed_slots`, `ring`, `workspace`), and the ring layout's `_read_ring` shares
`_decode_codes`.
"""

from __future__ import annotations

import torch

from .workspace import TransientWorkspace, kv_buffers


class DequantizedReads:
    def _quantized_slots(self, used: int) -> int:
        """How many of slots [0, used) a read takes from the codes (the rest: the append-only full-precision residual).
        Shared by `read` and `segments`. Append-only: a read shorter than the content truncates it (a crop); the slot
        layout and fixed slots read every slot from the codes, written or not (the layer masks what is not valid)."""
        if not self.append_only or self.fixed_slots:
            return used
        if used < self.length:
            self._truncate(used)
        elif used > self.length:
            raise RuntimeError(f"{self.where}: read of {used} slots, only {self.length} written")
        return self.qlen

    def _read_workspace(self):
        """Where reads dequantize to: the shared workspace, eager and compiled. Measured (SmolLM2, compiled decode vs
        compiled StaticCache, one idle interleaved run each): FP8 per-token 0.84x with the workspace vs 0.65x with
        fresh tensors per read, which let inductor fuse dequantization into the GQA expansion (done once per query
        head instead of once per KV head); per-head FP8 0.96x either way."""
        return self.workspace

    def _read_buffers(self, width: int):
        return kv_buffers(
            self._read_workspace(),
            "",
            self.batch,
            self.heads,
            width,
            self.head_dim,
            self.value_dim,
            self.dtype,
            self.device,
            self.joint,
        )

    def _decode_codes(self, width: int, codes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, width, D] from the read workspace, slots [0, codes) dequantized from the codes (the
        caller fills the rest). Shared by `read` and the ring layout's `_read_ring`."""
        workspace = self._read_workspace()
        out_k, out_v, both = self._read_buffers(width)
        if codes:
            bias = self._key_bias()
            if self.joint:
                self.keys_codec.decode_into(both[:, :, :codes], codes, workspace, bias)
            else:
                self.keys_codec.decode_into(out_k[:, :, :codes], codes, workspace, bias)
                self.values_codec.decode_into(out_v[:, :, :codes], codes, workspace)
        return out_k, out_v

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, used, D] in the model's dtype (views of the workspace: valid until the next read)."""
        if self.ring:
            return self._read_ring(used)
        quantized = self._quantized_slots(used)
        out_k, out_v = self._decode_codes(used, quantized)
        if used > quantized:
            out_k[:, :, quantized:].copy_(self.fp_k[:, :, : used - quantized])
            out_v[:, :, quantized:].copy_(self.fp_v[:, :, : used - quantized])
        return out_k, out_v

    def _key_bias(self) -> torch.Tensor | None:
        """The key mean to add back after dequantizing ([B or 2B, H, 1, D]; zero rows for values when joint)."""
        if not (self.key_smoothing and self.key_mean is not None):
            return None
        rows = 2 * self.batch if self.joint else self.batch
        cached = self._key_mean_cast
        if cached is None or cached.dtype != self.dtype or cached.shape[0] != rows:
            mean = self.key_mean.to(self.dtype).expand(self.batch, -1, -1, -1)
            if self.joint:
                mean = torch.cat((mean, torch.zeros_like(mean)), 0)
            self._key_mean_cast = cached = mean.contiguous()
        return cached

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [B, H, n, D] of the given slots [B, 1 or H, n] (fresh tensors). The slot layout dequantizes
        those slots only; the append-only layout reads everything and gathers."""
        if self.append_only:
            keys, values = self.read(self.length)
            index = slots[..., None].expand(self.batch, self.heads, slots.shape[-1], self.head_dim)
            value_index = slots[..., None].expand(self.batch, self.heads, slots.shape[-1], self.value_dim)
            return keys.gather(2, index), values.gather(2, value_index)
        shape = (self.batch, self.heads, slots.shape[-1], self.head_dim)
        scratch = TransientWorkspace()
        bias = self._key_bias()
        if self.joint:
            both = torch.empty((2 * self.batch,) + shape[1:], dtype=self.dtype, device=self.device)
            self.keys_codec.decode_slots(both, torch.cat((slots, slots), 0), scratch, bias)
            return both[: self.batch], both[self.batch :]
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape[:-1] + (self.value_dim,), dtype=self.dtype, device=self.device)
        self.keys_codec.decode_slots(keys, slots, scratch, bias)
        self.values_codec.decode_slots(values, slots, scratch)
        return keys, values
