"""One slot space split into regions, each with its own store (precision): slots [base, base + size) of the layer
go to region i's store. Used by CompositeCache (e.g. sinks in full precision, older tokens in FP8)."""

from __future__ import annotations

from typing import Callable

import torch


class RegionStore:
    def __init__(self, sizes: list[int | None], stores: list):
        """`sizes[i]` slots for region i (the last may be None: it grows). Each sub-store gets one extra slot, its
        own trash slot, which receives the writes meant for other regions."""
        self.sizes, self.stores = list(sizes), stores
        self.bases = [sum(s or 0 for s in self.sizes[:i]) for i in range(len(self.sizes))]

    @property
    def keys(self):  # for transformers code that inspects `layer.keys` (dtype, device)
        return self.stores[0].keys

    def allocate(self, batch, heads, head_dim, slots, dtype, device, value_dim=None) -> None:
        if self.sizes[-1] is None:
            self.sizes[-1] = slots - 1 - self.bases[-1]
        for size, store in zip(self.sizes, self.stores):
            store.allocate(batch, heads, head_dim, size + 1, dtype, device, value_dim)

    def grow(self, slots: int) -> None:
        self.sizes[-1] = slots - 1 - self.bases[-1]
        self.stores[-1].grow(self.sizes[-1] + 1)

    def _local(self, i: int, dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot indices in region i's store, the region's trash slot for the others; which ones are inside)."""
        base, size = self.bases[i], self.sizes[i]
        inside = (dest >= base) & (dest < base + size)
        return torch.where(inside, dest - base, size), inside

    def region_of(self, slot: int) -> int | None:
        """The region holding layer slot `slot` (None for the layer's trash slot)."""
        for i, (base, size) in enumerate(zip(self.bases, self.sizes)):
            if base <= slot < base + size:
                return i
        return None

    def _touched(self, regions) -> list[int]:
        """Regions to visit: the caller's host-side hint (decode: the policy knows which regions its slots are in),
        else all of them. Never read from the device: that would make an accelerator wait, once per layer."""
        if regions is not None:
            return sorted({r for r in regions if r is not None})
        return list(range(len(self.stores)))

    def write(self, dest: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start=None, regions=None) -> None:
        """Each region stores the tokens whose slot it holds; regions none of them lands in are skipped (most decode
        writes touch one region). Tokens meant for other regions go to each visited region's trash slot."""
        for i in self._touched(regions):
            self.stores[i].write(self._local(i, dest)[0], keys, values)

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts_k, parts_v = [], []
        for base, size, store in zip(self.bases, self.sizes, self.stores):
            n = min(size, used - base)
            if n <= 0:
                break
            k, v = store.read(n)
            parts_k.append(k)
            parts_v.append(v)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k, -2), torch.cat(parts_v, -2)

    def read_slots(self, slots: torch.Tensor, regions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [B, H, n, D] of the given slots [B, 1 or H, n] (each in some region; `regions`: see `write`)."""
        out_k = out_v = None
        for i in self._touched(regions):
            local, inside = self._local(i, slots)
            k, v = self.stores[i].read_slots(local)  # slots outside the region read this region's trash slot
            inside = inside[..., None]
            out_k = k if out_k is None else torch.where(inside, k, out_k)
            out_v = v if out_v is None else torch.where(inside, v, out_v)
        return out_k, out_v

    def write_keys_slice(self, start: int, keys: torch.Tensor) -> None:
        for base, size, store in zip(self.bases, self.sizes, self.stores):
            if base <= start < base + size:
                store.write_keys_slice(start - base, keys)
                return
        raise ValueError(f"slot {start} is in no region")

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.stores)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in self.stores:
            store.map_batch(fn)

    def reset(self) -> None:
        for store in self.stores:
            store.reset()

    def segments(self, used: int, stable: bool = False):
        """(key segments, value segments) of slots [0, used): each region's segments, regions in slot order (as
        `read` concatenates them), for attention straight from the codes (`hf_kvcache.kernels`)."""
        keys, values = [], []
        for base, size, store in zip(self.bases, self.sizes, self.stores):
            n = min(size, used - base)
            if n <= 0:
                break
            k, v = store.segments(n, stable)
            keys += k
            values += v
        return keys, values
