"""The layer's side of the policy contract: `LayerSlotView`, the `SlotView` (hf_kvcache.policies.view) a
`CompressedLayer` hands its policy. A thin facade over the layer's slot table and store: it reads the layer's current
tensors (they are replaced when the slots grow or the batch is reordered), and each change it offers is one the layer
would make itself."""

from __future__ import annotations

import torch


class LayerSlotView:
    __slots__ = ("_layer",)

    def __init__(self, layer):
        self._layer = layer

    # -- reads ----------------------------------------------------------------------------------------------------
    valid = property(lambda self: self._layer.slot_valid)
    positions = property(lambda self: self._layer.head_positions())
    seen = property(lambda self: self._layer.seen)
    used = property(lambda self: self._layer.used)
    trash_slot = property(lambda self: self._layer.slot_valid.shape[-1] - 1)
    layer_idx = property(lambda self: self._layer.layer_idx)
    ready = property(lambda self: self._layer.is_initialized)
    padded = property(lambda self: self._layer.forward_info.has_padding)
    incoming = property(lambda self: self._layer.incoming)
    has_regions = property(lambda self: hasattr(self._layer.store, "region_of"))
    writes_single_slots = property(lambda self: callable(getattr(self._layer.store, "write_slot", None)))

    pending = property(lambda self: self._layer._pending)  # a `Chunk`, or None

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layer.store.read(n)

    def region_of(self, slot: int) -> int:
        return self._layer.store.region_of(slot)

    # -- changes ------------------------------------------------------------------------------------------------
    def evict(self, keep: torch.Tensor, start: int = 0) -> None:
        self._layer.slot_valid[..., start : start + keep.shape[-1]] &= keep

    def forget_from(self, slot: int) -> None:
        self._layer.slot_valid[..., slot:] = False

    def commit(self, placement) -> None:
        self._layer.commit(placement)

    def move(self, src: torch.Tensor, dest: torch.Tensor, src_regions=None, dest_regions=None) -> torch.Tensor:
        layer = self._layer
        valid = layer.slot_valid.gather(2, src)
        pos = layer.slot_pos.gather(2, *pooled_index(layer.slot_pos, src)).view(src.shape)
        layer.slot_valid.scatter_(2, src, False)
        trash = layer.slot_valid.shape[-1] - 1
        dest = torch.where(dest >= 0, dest, trash)
        valid = valid & (dest != trash)
        if hasattr(layer.store, "move"):  # a region store: same-format moves copy codes (stores/regions.py)
            layer.store.move(src, dest, src_regions, dest_regions)
        else:
            keys, values = layer.store.read_slots(src)
            layer.store.write(dest, keys, values)
        layer.slot_valid.scatter_(2, dest, valid)
        layer.slot_pos.scatter_(2, *pooled_index(layer.slot_pos, dest, pos))
        return dest

    def write_keys(self, start: int, keys: torch.Tensor) -> None:
        self._layer.store.write_keys_slice(start, keys)

    def key_slots(self, start: int, n: int) -> torch.Tensor | None:
        key_slots = getattr(self._layer.store, "key_slots", None)
        return None if key_slots is None else key_slots(start, n)

    def check_crop(self, tokens: int) -> None:
        check = getattr(self._layer.store, "check_crop", None)
        if check is not None:
            check(tokens)


def pooled_index(slot_pos: torch.Tensor, index: torch.Tensor, values: torch.Tensor | None = None):
    """(index, values) for `slot_pos` [B, 1 or H, S]: per-head [B, H, n] slots flattened to [B, 1, H x n] when the
    positions are one per slot (a head-pooled store: the heads' slots are distinct)."""
    if slot_pos.shape[1] == index.shape[1]:
        return (index,) if values is None else (index, values)
    flat = index.reshape(index.shape[0], 1, -1)
    return (flat,) if values is None else (flat, values.reshape(values.shape[0], 1, -1))
