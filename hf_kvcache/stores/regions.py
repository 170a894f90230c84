"""One slot space split into regions, each with its own store (precision): slots [base, base + size) of the layer
go to region i's store. Used by CompositeCache (e.g. sinks in full precision, older tokens in FP8).

Reads (`read`) write every region straight into one output buffer of a dequantization workspace shared by the
layers of a cache (quantized regions dequantize into their slice of it, full-precision ones are copied): no
per-region temporaries and no concatenation. The returned tensors are views that the next read overwrites (as the
quantized caches' reads, hf_kvcache.stores.workspace). Without a shared workspace, each read allocates its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..common.compile_static import StaticInt
from .full import FullPrecisionStore
from .quantization import QuantSpec
from .quantized import QuantizedStore
from .workspace import TransientWorkspace, kv_buffers


class RegionStore:
    sizes, bases = StaticInt(), StaticInt()  # torch.compile specialises on them (hf_kvcache.common.compile_static)

    def __init__(self, sizes: list[int | None], stores: list, workspace=None):
        """`sizes[i]` slots for region i (the last may be None: it grows). Each sub-store gets one extra slot, its
        own trash slot, which receives the writes meant for other regions. `workspace`: the dequantization workspace
        reads write into (shared by the layers of a cache; None: fresh tensors per read)."""
        self.sizes, self.stores = list(sizes), stores
        self.bases = [sum(s or 0 for s in self.sizes[:i]) for i in range(len(self.sizes))]
        self.workspace = workspace if workspace is not None else TransientWorkspace()

    @property
    def keys(self):  # for transformers code that inspects `layer.keys` (dtype, device)
        return self.stores[0].keys

    @property
    def compileable(self) -> bool:
        return all(getattr(store, "compileable", False) for store in self.stores)

    def allocate(self, batch, heads, head_dim, slots, dtype, device, value_dim=None) -> None:
        self.heads, self.head_dim, self.value_dim = heads, head_dim, value_dim or head_dim
        self.dtype, self.device = dtype, device
        if self.sizes[-1] is None:
            self.sizes = self.sizes[:-1] + (slots - 1 - self.bases[-1],)
        for size, store in zip(self.sizes, self.stores):
            store.allocate(batch, heads, head_dim, size + 1, dtype, device, value_dim)

    def reserve_reads(self) -> None:
        """Allocate the workspace buffers of a read of every slot now, in eager code (`kv_buffers`; the layer calls it
        when attention or its scorer reads dequantized keys and values)."""
        self._read_buffers(sum(self.sizes))
        for store in self.stores:
            getattr(store, "reserve_scratch", lambda workspace: None)(self.workspace)

    def _read_buffers(self, width: int):
        batch = self.stores[0].keys.shape[0]  # (the batch may have changed since allocation: beams, row selection)
        # keys in rows [0, B), values in [B, 2B) of one buffer when they have one size: joint codecs fill both at once
        return kv_buffers(
            self.workspace,
            "regions_",
            batch,
            self.heads,
            width,
            self.head_dim,
            self.value_dim,
            self.dtype,
            self.device,
            joint=self.value_dim == self.head_dim,
        )

    def grow(self, slots: int) -> None:
        self.sizes = self.sizes[:-1] + (slots - 1 - self.bases[-1],)
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
        touched = self._touched(regions)
        for i in touched:
            if regions is not None and touched == [len(self.stores) - 1]:
                # one hinted region, the last: every token lands in it or in the layer's trash slot, which is the
                # slot right after it, i.e. its own trash slot (a decode step: one op instead of five)
                local = dest - self.bases[i]
            else:
                local = self._local(i, dest)[0]
            self.stores[i].write(local, keys, values)

    def read(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, used, D] of slots [0, used): each region written into its slice of one workspace
        buffer (views, valid until the next read of any layer sharing the workspace)."""
        parts = []
        for base, size, store in zip(self.bases, self.sizes, self.stores):
            n = min(size, used - base)
            if n <= 0:
                break
            parts.append((base, n, store))
        if len(parts) == 1 and isinstance(parts[0][2], FullPrecisionStore):
            return parts[0][2].read(used)  # views of the buffers themselves, no copy
        out_k, out_v, both = self._read_buffers(used)
        for base, n, store in parts:
            columns = slice(base, base + n)
            if isinstance(store, FullPrecisionStore):
                out_k[:, :, columns].copy_(store.keys[:, :, :n])
                out_v[:, :, columns].copy_(store.values[:, :, :n])
            elif both is not None and store.joint:  # one dequantization for the region's keys and values
                store.keys_codec.decode_into(both[:, :, columns], n, self.workspace, store._key_bias())
            else:
                store.keys_codec.decode_into(out_k[:, :, columns], n, self.workspace, store._key_bias())
                store.values_codec.decode_into(out_v[:, :, columns], n, self.workspace)
        return out_k, out_v

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

    def move(self, src: torch.Tensor, dest: torch.Tensor, src_regions=None, dest_regions=None) -> None:
        """Copy the tokens of slots `src` to slots `dest` ([B, 1 or H, n]; the layer's trash slot for none). Between
        two regions that hold tokens in the same per-token format (the hints name one region each), the codes and
        their scales are copied as they are: no dequantization, no second rounding. Otherwise (other precisions, or
        no hints: prefill chunks) the tokens are dequantized and written, i.e. quantized to the destination's
        format."""
        src_r, dest_r = self._touched(src_regions), self._touched(dest_regions)
        if not dest_r:  # every token dropped (evicted): nothing to read
            return
        if len(src_r) == 1 and len(dest_r) == 1 and _same_codes(self.stores[src_r[0]], self.stores[dest_r[0]]):
            local_src = src - self.bases[src_r[0]]  # (the hint: every source is in that region)
            local_dest = self._local(dest_r[0], dest)[0]
            source, target = self.stores[src_r[0]], self.stores[dest_r[0]]
            for from_codec, to_codec in zip(source._codecs(), target._codecs()):
                rows_src, rows_dest = (torch.cat((i, i), 0) if source.joint else i for i in (local_src, local_dest))
                codes = {}
                for name, t in from_codec.slot.items():
                    index = rows_src.reshape(rows_src.shape + (1,) * (t.dim() - 3))
                    codes[name] = t.gather(2, index.expand(t.shape[0], t.shape[1], index.shape[2], *t.shape[3:]))
                to_codec.put(codes, dest=rows_dest)
            return
        keys, values = self.read_slots(src, regions=src_regions)
        self.write(dest, keys, values, regions=dest_regions)

    def key_slots(self, start: int, n: int) -> torch.Tensor | None:
        """A writable view [B, H, n, D] of the keys of slots [start, start + n) when one full-precision region holds
        them all (the composite's sinks: re-rotated in place, policies/sinks.py), else None."""
        for base, size, store in zip(self.bases, self.sizes, self.stores):
            if base <= start < base + size:
                if start + n > base + size or not isinstance(store, FullPrecisionStore) or store.keys is None:
                    return None
                return store.keys[:, :, start - base : start - base + n]
        return None

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


def _same_codes(a, b) -> bool:
    """Whether tokens can move from store `a` to store `b` as codes: both quantized stores with the same specs and
    scales that travel with each token (per-token granularity; fixed per-tensor/head scales are each store's own),
    no key smoothing (each store has its own key mean)."""
    if not (hasattr(a, "keys_codec") and hasattr(b, "keys_codec")):  # (a quantized store; not imported here: the
        return False  # quantization module may be unavailable while full-precision regions still work)
    if (a.key_spec, a.value_spec, a.joint) != (b.key_spec, b.value_spec, b.joint) or a.key_smoothing or b.key_smoothing:
        return False
    return all(spec.granularity == "token" for spec in (a.key_spec, a.value_spec)) and all(
        codec.block == 1 and not codec.per_block and not getattr(codec, "token_pairs", False) for codec in a._codecs()
    )


def slot_specs(keys: Any, values: Any, names: tuple[str, str]) -> tuple[QuantSpec, QuantSpec]:
    """(key spec, value spec) for a store written slot by slot (an evicting cache's): per-token granularity, since
    'channel' quantizes blocks of tokens once they are complete (the append-only keep-all layout). `names`: how the
    errors name the two fields."""
    specs = (QuantSpec.from_value(keys, names[0]), QuantSpec.from_value(values, names[1]))
    for name, spec in zip(names, specs):
        if spec.append_only:
            raise ValueError(
                f"{name}: granularity 'channel' needs the append-only keep-all layout (QuantizedFP8Cache / "
                "KIVICache); a store written slot by slot (an evicting cache's) needs granularity 'token'."
            )
    return specs


def store_for_precisions(keys: Any, values: Any, where: str = "store", workspace=None):
    """A slot store for a region of a CompositeCache (arbitrary slot writes): key and value precisions as format
    names ("full", "fp8_e4m3", "int4" ...), spec dicts or QuantSpecs, per-token (`slot_specs`)."""
    key_spec, value_spec = slot_specs(keys, values, (f"{where}.keys", f"{where}.values"))
    return QuantizedStore(key_spec, value_spec, append_only=False, workspace=workspace, name=where)
