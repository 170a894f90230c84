"""Byte layout of one cached token (keys or values of one layer) in a quantized page, and the codec views over it.

transformers' paged cache is one flat uint8 tensor. Its full-attention allocator cuts it into rows of
`[num_kv_heads, head_dim]` in the model's dtype: a page of a layer is `page_size` key rows then `page_size` value
rows, and a token's physical index addresses a row. We keep that geometry exactly (so transformers' physical
indices, block copies for forks and CPU offloading stay valid) and only change what a row holds: a *record* of
`record_bytes` bytes, the codes of all KV heads followed by their scales (and integer zero points):

    [ codes: heads x code_width uint8 | scale: heads x groups (scale dtype) | zero: ... | padding ]

Each field starts at a multiple of its element size and the record is padded to the largest one (2 bytes for
bfloat16 scales), so every field can be viewed in place with its dtype and no byte is wasted beyond that.

`TokenRecord.codec_views(rows)` turns a `[rows, record_bytes]` uint8 view into the slot tensors our codecs
(hf_kvcache.stores.quantization.Codec) read and write, shaped `[1, heads, rows, ...]` (strided views of the same
bytes, nothing copied): `Codec.put(..., index=...)` then writes pages in place and `Codec.decode_slots` gathers and
dequantizes the rows of a request.
"""

from __future__ import annotations

import math

import torch

from ..stores.factory import make_codec
from ..stores.quantization import Codec, QuantSpec
from ..stores.workspace import TransientWorkspace


class TokenRecord:
    """Layout of the record of one token (all KV heads) for a codec spec, model dtype and head shape."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        self.spec, self.heads, self.head_dim, self.dtype = spec, heads, head_dim, dtype
        probe = make_codec(spec)
        probe.allocate(1, heads, head_dim, 0, dtype, "cpu")  # fixes head_dim / dtype; no memory
        self.fields: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []  # name, trailing shape, dtype, offset
        offset, align = 0, 1
        for name, (shape, dt) in probe._slot_shapes().items():
            size = torch.empty((), dtype=dt).element_size()
            align = max(align, size)
            offset = -(-offset // size) * size
            self.fields.append((name, shape, dt, offset))
            offset += heads * math.prod(shape) * size
        self.payload_bytes = offset
        self.record_bytes = -(-offset // align) * align

    def new_codec(self, device) -> Codec:
        """A codec for one layer and kind (keys or values) whose slot tensors are set by `codec_views`."""
        codec = make_codec(self.spec)
        codec.allocate(1, self.heads, self.head_dim, 0, self.dtype, device)
        return codec

    def codec_views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """rows: uint8 [n, record_bytes] (any row stride) -> {name: [1, heads, n, *shape]} views of those bytes."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.record_bytes:
            raise ValueError(f"expected uint8 rows [n, {self.record_bytes}], got {rows.dtype} {tuple(rows.shape)}")
        views = {}
        for name, shape, dt, offset in self.fields:
            size = torch.empty((), dtype=dt).element_size()
            width = self.heads * math.prod(shape) * size
            field = rows[:, offset : offset + width].view(dt)  # [n, heads * prod(shape)]
            views[name] = field.unflatten(1, (self.heads, *shape)).movedim(1, 0).unsqueeze(0)
        return views


def encode_rows(codec: Codec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [n, heads, head_dim] (transformers' paged layout) -> the codec's encoded tensors [1, heads, n, ...]."""
    return codec.encode(x.transpose(0, 1).unsqueeze(0))


def decode_rows(codec: Codec, index: torch.Tensor, dtype: torch.dtype, workspace=None) -> torch.Tensor:
    """Dequantize the rows `index` [n] of the codec's slot views into a new tensor [n, heads, head_dim] (a view
    of a [1, heads, n, head_dim] buffer). Only those rows are gathered: O(n), not O(pages)."""
    n = index.shape[0]
    out = torch.empty(1, codec.heads, n, codec.head_dim, dtype=dtype, device=index.device)
    if n:
        codec.decode_slots(out, index.view(1, 1, n), workspace or TransientWorkspace())
    return out[0].transpose(0, 1)
