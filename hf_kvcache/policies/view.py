"""What a policy is given of the layer it serves: the `SlotView` contract.

A policy decides; the layer owns the slots. Every policy hook receives a `SlotView` (never the layer), which shows
the slot table read-only (validity, position ids, counters), the tokens being placed, the stored keys and values,
and offers the few changes a policy may ask for: drop tokens (`evict`, `forget_from`), place a waiting chunk
(`commit`), move tokens between slots (`move`), and write re-rotated keys (`write_keys`, `key_slots`). Everything
else a policy decides it returns (a `Placement`). `tests/test_package_layout.py` checks that policies touch nothing
else. The layer's implementation is `hf_kvcache.layers.slot_view.LayerSlotView`.

Shapes: B batch rows, Hm the meta heads (1 when all KV heads keep the same tokens, else the KV heads), `slots + 1`
slot columns, the last being the trash slot where dropped writes land.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Chunk(NamedTuple):
    """A multi-token forward waiting for its placement (deferred policies choose survivors after attention)."""

    keys: torch.Tensor  # [B, H, q, D] as the model computed them (rotated keys when the cache rotates keys)
    values: torch.Tensor  # [B, H, q, Dv]
    real: torch.Tensor  # [B, q] bool: not padding
    positions: torch.Tensor  # [B, q] position ids
    seen_before: int  # stream index of its first token


class Incoming(NamedTuple):
    """The tokens of the current update, being placed (read by policies that score tokens as they arrive)."""

    keys: torch.Tensor  # [B, H, q, D]
    values: torch.Tensor  # [B, H, q, Dv]
    positions: torch.Tensor  # [B, q] position ids


class SlotView(Protocol):
    # -- what a policy may read -----------------------------------------------------------------------------------
    valid: torch.Tensor  # [B, Hm, slots + 1] bool: the slot holds a real token (do not write: use evict / move)
    positions: torch.Tensor | None  # [B, Hm, slots + 1] int32 position ids (None when the policy needs none)
    seen: int  # tokens of the stream so far (those of the current update included once it is placed)
    used: int  # slot columns attention reads
    trash_slot: int  # the last column: writes aimed at it are dropped
    layer_idx: int  # the model layer (RoPE plans are per layer)
    ready: bool  # the layer has allocated its slots (a first forward happened)
    padded: bool  # the stream has had padding (rows then differ in layout)
    incoming: Incoming | None  # the tokens being placed
    pending: Chunk | None  # the chunk waiting for a deferred policy's `commit`, else None
    has_regions: bool  # the store splits its slots into regions of their own format (CompositeCache)
    writes_single_slots: bool  # the store takes one-token writes into a known slot (the decode fast path)

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `n` slots, dequantized to the model's dtype."""

    def region_of(self, slot: int) -> int:
        """The region holding `slot` (only with `has_regions`): a host-side hint for region stores."""

    # -- what a policy may ask for ----------------------------------------------------------------------------------
    def evict(self, keep: torch.Tensor, start: int = 0) -> None:
        """Drop the tokens of slots start .. start + n - 1 where `keep` [B, Hm or 1, n] is False."""

    def forget_from(self, slot: int) -> None:
        """Drop every token from `slot` on (crops, the end of a compressed prompt)."""

    def commit(self, placement) -> None:
        """Write the pending chunk's survivors where `placement` says (deferred policies, once they have scores)."""

    def move(self, src: torch.Tensor, dest: torch.Tensor, src_regions=None, dest_regions=None) -> torch.Tensor:
        """Move the tokens of slots `src` to `dest` ([B, Hm, n]; dest -1: drop), vacating the sources; keys,
        values, validity and positions go along. `src_regions` / `dest_regions`: the regions they can be in, when
        known on the host. Returns dest with drops aimed at the trash slot (for the policy's own per-slot state)."""

    def write_keys(self, start: int, keys: torch.Tensor) -> None:
        """Overwrite the keys of slots start .. start + n - 1 (re-rotated keys)."""

    def key_slots(self, start: int, n: int) -> torch.Tensor | None:
        """A writable full-precision view [B, H, n, D] of the keys of slots start .. start + n - 1, or None when the
        store has none there."""

    def check_crop(self, tokens: int) -> None:
        """Raise if the store cannot drop the tokens past `tokens` now (quantized stores)."""
