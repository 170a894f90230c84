"""Keys and values kept in the model's own dtype, in preallocated slot buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.compile_static import fixed_shape


class FullPrecisionStore:
    """Slot buffers [batch, kv_heads, slots, head_dim]; writes scatter into slots, reads are views (no copy)."""

    compileable = True  # in-place writes into fixed buffers, views for reads

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

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
        self.keys = torch.zeros(batch, heads, slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, slots, value_dim or head_dim, dtype=dtype, device=device)
        fixed_shape(self.keys, self.values)

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def grow(self, slots: int) -> None:
        """Grow to `slots` slots, keeping the content (amortised by the caller's doubling)."""
        extra = slots - self.slots
        if extra > 0:
            pad = (0, 0, 0, extra)
            self.keys = torch.nn.functional.pad(self.keys, pad)
            self.values = torch.nn.functional.pad(self.values, pad)

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start=None, regions=None) -> None:
        """dest [B, H or 1, n] slot indices for the n tokens in keys/values [B, H, n, D] (the placement's host-side
        hints `start` and `regions` are for other stores)."""
        index = dest[..., None].expand(keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3])
        self.keys.scatter_(2, index, keys.to(self.keys.dtype))
        if values.shape[-1] != keys.shape[-1]:
            index = dest[..., None].expand(values.shape)
        self.values.scatter_(2, index, values.to(self.values.dtype))

    def write_slot(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """One token [B, H, 1, D] into one slot shared by all rows and heads (`index`: the slot as a 1-element tensor,
        so compiled code does not specialise on the slot number)."""
        if index is None:
            index = torch.full((1,), slot, dtype=torch.long, device=self.keys.device)
        self.keys.index_copy_(2, index, keys.to(self.keys.dtype))
        self.values.index_copy_(2, index, values.to(self.values.dtype))

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :used], self.values[:, :, :used]

    def read_slots(self, slots: torch.Tensor, regions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [B, H, n, D] of the given slots [B, 1 or H, n] (copies)."""
        index = slots[..., None].expand(self.keys.shape[0], self.keys.shape[1], slots.shape[-1], self.keys.shape[-1])
        value_index = slots[..., None].expand(index.shape[:-1] + (self.values.shape[-1],))
        return self.keys.gather(2, index), self.values.gather(2, value_index)

    def key_slots(self, start: int, n: int) -> torch.Tensor | None:
        """A writable view [B, H, n, D] of the keys of slots [start, start + n) (the sinks, re-rotated in place at
        every decode step: policies/sinks.py), or None before the first write."""
        if self.keys is None or start + n > self.keys.shape[2]:
            return None
        return self.keys[:, :, start : start + n]

    def write_keys_slice(self, start: int, keys: torch.Tensor) -> None:
        """Overwrite keys of slots [start, start + n) (re-rotated sinks)."""
        self.keys[:, :, start : start + keys.shape[2]] = keys

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reset(self) -> None:
        self.keys = self.values = None

    def segments(self, used: int, stable: bool = False):
        """Slots [0, used) as one full-precision `hf_kvcache.kernels.QuantizedKV` run each for keys and values
        (views; `stable=True` copies them, since slot writes overwrite in place)."""
        from ..kernels.codes import QuantizedKV

        keys, values = self.keys[:, :, :used], self.values[:, :, :used]
        if stable:
            keys, values = keys.clone(), values.clone()
        return [QuantizedKV(keys, "none")], [QuantizedKV(values, "none")]

    def capacity_buffers(self) -> tuple:
        """The buffers `capacity_segments` views (see `CodeSegments.capacity_buffers`)."""
        return self.keys, self.values

    def capacity_segments(self):
        """`segments` over the whole buffers (see `CodeSegments.capacity_segments`)."""
        from ..kernels.codes import QuantizedKV

        return [QuantizedKV(self.keys, "none")], [QuantizedKV(self.values, "none")]

    def segment_lengths(self, used: int) -> list[int]:
        return [used]
