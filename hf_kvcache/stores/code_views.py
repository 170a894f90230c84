"""A store's codecs as `hf_kvcache.kernels.QuantizedKV` views (no copy), for the attention kernels: the adapter between
the stores' slot buffers and the kernels' description of a run of codes, scales and zero points."""

from __future__ import annotations

import torch

from ..kernels.codes import QuantizedKV
from .fp8 import FP8Codec
from .integer import IntegerCodec
from .quantization import FullCodec


def from_codec(codec, n: int, rows: slice | None = None, bias: torch.Tensor | None = None) -> QuantizedKV:
    """Slots [0, n) of a codec from `hf_kvcache.stores` (FP8Codec, IntegerCodec or FullCodec) as a QuantizedKV of
    views (no copy). `rows`: the batch rows to take (a joint codec holds keys in [0, B) and values in [B, 2B));
    `bias`: [B or 1, H, 1, D] added after dequantizing (smoothed keys)."""
    rows = rows if rows is not None else slice(None)
    slot = {name: t[rows] for name, t in codec.slot.items()}
    spec = codec.spec
    if isinstance(codec, FullCodec):
        return QuantizedKV(slot["data"][:, :, :n], "none", bias=bias)
    if isinstance(codec, FP8Codec):
        gran = spec.granularity
        if gran == "token":
            return QuantizedKV(
                slot["data"][:, :, :n],
                spec.format,
                slot["scale"][:, :, :n],
                "token",
                spec.channel_group(codec.head_dim),
                scale_pow2=codec.pow2,
                bias=bias,
            )
        if gran == "channel":
            return QuantizedKV(
                slot["data"][:, :, :n],
                spec.format,
                slot["scale"][:, :, : n // codec.block],
                "channel",
                codec.block,
                scale_pow2=codec.pow2,
                bias=bias,
            )
        if codec.scale is None:
            raise ValueError("from_codec: this FP8 codec has no fixed scale yet (nothing was written)")
        return QuantizedKV(slot["data"][:, :, :n], spec.format, codec.scale, "fixed", bias=bias)
    if isinstance(codec, IntegerCodec):
        p = codec.per_byte
        token_packed = codec.token_pairs
        data = slot["data"][:, :, : n // p] if token_packed else slot["data"][:, :, :n]
        if spec.granularity == "token":
            scale, zero = slot["scale"][:, :, :n], slot["zero"][:, :, :n]
            group = codec._group()
        else:
            scale, zero = slot["scale"][:, :, : n // codec.block], slot["zero"][:, :, : n // codec.block]
            group = codec.block
        return QuantizedKV(
            data,
            spec.format,
            scale,
            spec.granularity,
            group,
            zero=zero,
            zero_is_code=codec.backend == "hqq",
            packing="token" if token_packed else "channel",
            pack_order="hqq" if codec.backend == "hqq" else "quanto",
            pack_block=codec.pack_block if token_packed else None,
            bias=bias,
        )
    raise TypeError(f"from_codec: unsupported codec {type(codec).__name__}")


def store_segments(store, used: int) -> tuple[list[QuantizedKV], list[QuantizedKV]]:
    """(key segments, value segments) of the first `used` slots of a store with a `segments` method
    (`QuantizedStore`: its quantized slots, then its full-precision residual; `RegionStore`: each region's in slot
    order). Views, no copy; valid until the next write."""
    if not hasattr(store, "segments"):
        raise TypeError(
            f"store_segments: {type(store).__name__} has no `segments` method (QuantizedStore, "
            "RegionStore and FullPrecisionStore have one)"
        )
    return store.segments(used)
