"""The attention sinks' re-rotation into a store's sink slots, on CPU, in one native call (`cpu_rope.cpp`, built with
the native attention kernel, hf_kvcache.kernels.cpu_blockwise).

A sink cache re-rotates its sinks at every decode step in every layer (hf_kvcache.policies.sinks); in torch that is
a dozen eager ops on a few hundred numbers, ~10 us each inside a decode step. The native call does the same float32
arithmetic (its cos / sin may differ from torch's in the last bit: tests/test_sink_rotation.py). Eager CPU code only:
under torch.compile the torch path is traced.
"""

from __future__ import annotations

import torch

from . import cpu_blockwise

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rotate_sinks_into(
    keys: torch.Tensor,
    target: torch.Tensor,
    oldest: torch.Tensor,
    shift: torch.Tensor,
    has_other: torch.Tensor | None,
    inv_freq: torch.Tensor,
    convention: str,
) -> bool:
    """Write into `target` [B, H, S, D] (the store's sink slots) the arrived sink keys `keys` [B, H, >= S, D] rotated
    to sit just before `oldest` [B, Hm] (sink i by oldest + shift[:, 0, i], or not at all where `has_other` is
    False), with RoPE frequencies `inv_freq` [r / 2] on the first r dims in `convention` ("half" or
    "interleaved"). Returns False, having done nothing, where the native call does not apply (then use torch)."""
    if convention not in ("half", "interleaved") or keys.dtype != target.dtype or target.dtype not in _DTYPES:
        return False
    if oldest.is_floating_point() or keys.stride(-1) != 1 or target.stride(-1) != 1:
        return False
    if cpu_blockwise.unusable(keys, target, oldest, shift, inv_freq) is not None:
        return False
    cpu_blockwise._module.rotate_sinks(
        keys, target, oldest.long(), shift, has_other, inv_freq.float().contiguous(), convention == "interleaved"
    )  # (padded rows' oldest positions are int32)
    return True


__all__ = ["rotate_sinks_into"]
