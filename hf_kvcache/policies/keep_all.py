"""Keep every token: the reference policy, and the base of quantized caches without eviction."""

from __future__ import annotations

import torch

from .base import Placement, Policy


class KeepAllPolicy(Policy):
    capacity = None
    needs_positions = False  # slot i holds the i-th token: no per-slot position ids to keep

    def place(self, layer, real: torch.Tensor, seen: int) -> Placement:
        batch, q = real.shape
        src = torch.arange(q, device=real.device).expand(batch, 1, q)
        return Placement(src=src, dest=src + seen, valid=real[:, None, :], start=seen)

    def decode_slot(self, layer, seen: int) -> int | None:
        return seen

    def used_after(self, seen: int) -> int:
        return seen

    def has_evicted(self, seen: int) -> bool:
        return False

    def crop(self, layer, new_seen: int) -> None:
        layer.slot_valid[..., new_seen:] = False
