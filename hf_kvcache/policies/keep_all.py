"""Keep every token: the reference policy, and the base of quantized caches without eviction."""

from __future__ import annotations

import torch

from .base import Placement, Policy


class KeepAllPolicy(Policy):
    """`capacity`: None (grows), or a fixed maximum length (preallocated; a clear error past it), which keeps
    decode shapes constant for torch.compile."""

    needs_positions = False  # slot i holds the i-th token: no per-slot position ids to keep
    compileable = True

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity

    def _check_room(self, tokens: int) -> None:
        if self.capacity is not None and tokens > self.capacity:
            raise ValueError(
                f"`max_length` is {self.capacity} tokens; this forward would make it {tokens}. Build the cache with "
                "a larger max_length (or none: the cache then grows)."
            )

    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        batch, q = real.shape
        self._check_room(seen + q)
        src = torch.arange(q, device=real.device).expand(batch, 1, q)
        return Placement(src=src, dest=src + seen, valid=real[:, None, :], start=seen)

    def decode_slot(self, view, seen: int) -> int | None:
        self._check_room(seen + 1)
        return seen

    def used_after(self, seen: int) -> int:
        return seen

    def has_evicted(self, seen: int) -> bool:
        return False

    def crop(self, view, new_seen: int) -> None:
        view.check_crop(new_seen)  # quantized stores refuse a crop they cannot apply now, not at the next forward
        view.forget_from(new_seen)
