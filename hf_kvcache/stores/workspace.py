"""One dequantization workspace shared by the layers of a cache.

Attention needs keys and values in the model's dtype, but a quantized cache must not keep a full-precision copy per
layer. Each layer's read dequantizes into the same buffers, which attention consumes before the next layer runs
(transformers runs layers one after the other), so peak memory is the quantized cache plus one layer's worth.

The returned tensors are views that the next read overwrites: a caller that keeps them across layers must copy
them. A store given no workspace allocates fresh tensors per read instead (safe for any use, more allocation).
"""

from __future__ import annotations

import math

import torch

from ..common.compile_static import fixed_shape


class DequantWorkspace:
    """Flat buffers per (role, dtype, device), grown by doubling (amortised) and viewed at the shape asked for."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A contiguous tensor of `shape` (contents undefined) that stays valid until the next `get` of `role`."""
        numel = math.prod(shape)
        key = (role, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = numel if buf is None else max(numel, 2 * buf.numel())
            buf = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
            fixed_shape(buf)
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


class TransientWorkspace:
    """No sharing: fresh tensors per read (the default of a standalone store)."""

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def nbytes(self) -> int:
        return 0

    def clear(self) -> None:
        pass


def kv_buffers(
    workspace,
    prefix: str,
    batch: int,
    heads: int,
    width: int,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device,
    joint: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A read's keys [B, H, width, head_dim] and values [B, H, width, value_dim] from `workspace` (roles `prefix` +
    "keys" / "values"), and, when `joint`, the one [2B, H, width, head_dim] buffer (role `prefix` + "kv") they are
    rows [0, B) and [B, 2B) of, for codecs that decode keys and values at once (else None).

    Stores also call it at allocation, results unused, so that a compiled decode step finds its buffers allocated in
    eager code, with fixed shapes (a buffer first allocated inside a compiled step escapes `fixed_shape`, and its size
    turns symbolic once a cache of another size runs through the same compiled code:
    hf_kvcache.common.compile_static)."""
    shape = (batch, heads, width, head_dim)
    if joint:
        both = workspace.get(prefix + "kv", (2 * batch,) + shape[1:], dtype, device)
        return both[:batch], both[batch:], both
    return (
        workspace.get(prefix + "keys", shape, dtype, device),
        workspace.get(prefix + "values", shape[:-1] + (value_dim,), dtype, device),
        None,
    )
