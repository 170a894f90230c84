"""One slot pool shared by a layer's KV heads: the storage of head-adaptive budgets (AdaKV, arXiv 2407.11550).

With head-adaptive budgets a layer holds `budget x kv_heads` tokens in all, allotted to its heads by score, so one
head may keep five times what another keeps. Slot buffers per head would have to be as long as the largest head;
this store keeps one buffer [batch, 1, slots, head_dim] instead, each slot holding one head's token (the policy
gives every (row, head) token its own slot and the layer's per-head validity says which head a slot belongs to),
so the bytes held are exactly the layer's budget.

Reads return the pool seen from every head ([batch, kv_heads, n, head_dim], a stride-0 view: no copy); each head's
attention masks the other heads' slots (the layer's validity), so it reads `kv_heads` times the slots of a uniform
per-head budget. transformers' GQA expansion (`repeat_kv`) copies that view per query head, as it copies any cache's
keys.
"""

from __future__ import annotations

import torch

from .full import FullPrecisionStore
from .quantized import QuantizedStore


class HeadPool:
    """Mixin over a slot store: the store holds one pooled head [B, 1, slots, D] and is seen as `pool_heads` heads.
    Any slot store works underneath (full precision, or quantized per token: the pool's codes are the kept tokens'
    only, so quantizing them costs nothing beyond the kept tokens)."""

    compileable = False  # (not compiled with fullgraph yet: the scorer caches that use it are not either)
    write_slot = None  # no shared-slot fast path: every head's token has its own slot
    segments = None  # attention from codes does not read it (hf_kvcache.layers.codes_read.reads_codes)
    pool_heads = 0

    def allocate(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        slots: int,
        dtype: torch.dtype,
        device,
        value_dim: int | None = None,
    ) -> None:
        self.pool_heads = heads
        super().allocate(batch, 1, head_dim, slots, dtype, device, value_dim)

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start=None, regions=None) -> None:
        """dest [B, H, n] distinct pool slots of each head's n tokens, keys/values [B, H, n, D]."""
        batch, heads, n = keys.shape[:3]
        dest = dest.expand(batch, heads, n).reshape(batch, 1, heads * n)
        super().write(dest, keys.reshape(batch, 1, heads * n, -1), values.reshape(batch, 1, heads * n, -1))

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().read(used)
        return self._every_head(keys), self._every_head(values)

    def read_slots(self, slots: torch.Tensor, regions=None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, n = slots.shape
        keys, values = super().read_slots(slots.reshape(batch, 1, heads * n))
        return keys.reshape(batch, heads, n, -1), values.reshape(batch, heads, n, -1)

    def _every_head(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(x.shape[0], self.pool_heads, x.shape[2], x.shape[3])

    def write_keys_slice(self, start: int, keys: torch.Tensor) -> None:
        raise NotImplementedError("a head-pooled store keeps keys at their original positions (no re-rotation)")


class HeadPooledStore(HeadPool, FullPrecisionStore):
    """The pool in the model's dtype."""


class HeadPooledQuantizedStore(HeadPool, QuantizedStore):
    """The pool quantized per token (a QuantizedStore's slot layout: FP8 or INT codes, any key/value specs that
    quantize each token on its own)."""
