"""`QuantizedKV`: quantized keys or values as attention kernels read them, and adapters from our codecs and stores.

A `QuantizedKV` is one run of `n` tokens of one tensor kind (keys or values) for `B` batch rows and `H` KV heads:

    x[b, h, t, d] = dequant(codes)[b, h, t, d] * scale[...] + zero[...] + bias[b, h, 0, d]
    (or (codes - zero) * scale + bias when `zero_is_code`, hqq's convention)

- `format`: "fp8_e4m3" / "fp8_e5m2" (codes: uint8 FP8 bits [B, H, n, D]), "int8" / "int4" / "int2" (unsigned
  codes, packed 8 / bits per byte), "none" (codes are the values themselves, any float dtype, no scale).
- `granularity` (what one scale covers): "token" -> scale [B, H, n, D // group_size] (`group_size` channels of a
  token; the whole head when group_size == D); "channel" -> scale [B, H, n // group_size, D] (one channel over a
  block of `group_size` tokens, KIVI keys); "fixed" -> scale broadcastable to [B, H, 1, 1] (per tensor / head).
- `scale_pow2`: the scale is stored as int8 exponents e (value 2^e, OCP e8m0); otherwise any float dtype.
- `zero`: optional, same shape as `scale` (integer formats are asymmetric).
- packing (int4 / int2): `packing="channel"` -> codes [B, H, n, D / p], byte j holds channels j + i * D / p for
  i < p (p = 8 / bits); `packing="token"` -> codes [B, H, n / p, D], within each block of `pack_block` tokens byte
  row r holds tokens r + i * pack_block / p. `pack_order`: "quanto" puts value i at bit bits * i, "hqq" at bit
  8 - bits * (i + 1).
- `bias`: optional float [B or 1, H, 1, D] added after dequantizing (the key mean of smoothed keys).

Kernels walk a `QuantizedKV` in blocks of tokens (`dequantize_block`), so no full-precision copy of it is made.
Blocks must start at multiples of `token_alignment` (channel-granular scales and token packing cover several tokens).

Adapters from our stores live with them (hf_kvcache.stores.code_views: `from_codec(codec, n)` views a codec's slot
buffers, no copy; `store_segments(store, used)` returns a store's key and value segments): kernels know nothing of
stores.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT_FORMATS = {"int8": 8, "int4": 4, "int2": 2}
FORMATS = tuple(FP8_FORMATS) + tuple(INT_FORMATS) + ("none",)
GRANULARITIES = ("token", "channel", "fixed")
PACKINGS = ("channel", "token")
PACK_ORDERS = ("quanto", "hqq")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"QuantizedKV: `{name}` must be one of {allowed}, got {value!r}")


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """One quantized run of keys or values (see the module docstring for the layout of each field)."""

    codes: torch.Tensor
    format: str
    scale: torch.Tensor | None = None
    granularity: str = "token"
    group_size: int | None = None
    zero: torch.Tensor | None = None
    zero_is_code: bool = False
    scale_pow2: bool = False
    packing: str = "channel"
    pack_order: str = "quanto"
    pack_block: int | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self):
        _choice("format", self.format, FORMATS)
        _choice("granularity", self.granularity, GRANULARITIES)
        _choice("packing", self.packing, PACKINGS)
        _choice("pack_order", self.pack_order, PACK_ORDERS)
        if self.codes.dim() != 4:
            raise ValueError(f"QuantizedKV: `codes` must be 4-D [B, H, n, D], got shape {list(self.codes.shape)}")
        if self.format == "none":
            if not self.codes.is_floating_point():
                raise ValueError(f"QuantizedKV: format 'none' takes float codes (the values), got {self.codes.dtype}")
            if self.scale is not None or self.zero is not None:
                raise ValueError("QuantizedKV: format 'none' takes no `scale` or `zero`")
        else:
            if self.codes.dtype != torch.uint8:
                raise ValueError(f"QuantizedKV: format {self.format!r} takes uint8 `codes`, got {self.codes.dtype}")
            if self.scale is None:
                raise ValueError(f"QuantizedKV: format {self.format!r} needs a `scale`")
            if self.scale_pow2 and self.scale.dtype != torch.int8:
                raise ValueError(f"QuantizedKV: `scale_pow2` scales are int8 exponents, got {self.scale.dtype}")
            if not self.scale_pow2 and not self.scale.is_floating_point():
                raise ValueError(
                    f"QuantizedKV: `scale` must be a float tensor (or int8 with scale_pow2), got {self.scale.dtype}"
                )
        if self.zero is not None and (self.scale is None or self.zero.shape != self.scale.shape):
            raise ValueError("QuantizedKV: `zero` must have the shape of `scale`")
        if self.zero_is_code and self.zero is None:
            raise ValueError("QuantizedKV: `zero_is_code=True` needs a `zero`")
        if self.per_byte > 1 and self.packing == "token":
            if self.pack_block is None or self.pack_block % self.per_byte:
                raise ValueError(
                    f"QuantizedKV: token packing needs `pack_block` a multiple of {self.per_byte}, got "
                    f"{self.pack_block}"
                )
            if self.length % self.pack_block:
                raise ValueError(
                    f"QuantizedKV: token packing needs whole blocks of {self.pack_block} tokens, got {self.length}"
                )
        self._check_scale_shape()
        if self.bias is not None:
            b, _h, _, _d = self.codes.shape
            if (
                self.bias.dim() != 4
                or self.bias.shape[1:] != (self.heads, 1, self.head_dim)
                or self.bias.shape[0] not in (1, b)
            ):
                raise ValueError(
                    f"QuantizedKV: `bias` must be [B or 1, H, 1, D] = [{b} or 1, {self.heads}, 1, "
                    f"{self.head_dim}], got {list(self.bias.shape)}"
                )

    def _check_scale_shape(self) -> None:
        if self.scale is None:
            return
        b, h, n, d = self.batch, self.heads, self.length, self.head_dim
        shape = tuple(self.scale.shape)
        if self.granularity == "fixed":
            ok = len(shape) == 4 and shape[0] in (1, b) and shape[1] in (1, h) and shape[2:] == (1, 1)
            want = f"[{b} or 1, {h} or 1, 1, 1]"
        else:
            g = self.group_size
            if g is None or g < 1:
                raise ValueError(f"QuantizedKV: granularity {self.granularity!r} needs `group_size` >= 1, got {g}")
            if self.granularity == "token":
                if d % g:
                    raise ValueError(f"QuantizedKV: `group_size` ({g}) must divide the head dim ({d})")
                want_shape = (b, h, n, d // g)
            else:
                if n % g:
                    raise ValueError(f"QuantizedKV: channel scales need whole blocks of {g} tokens, got n={n}")
                want_shape = (b, h, n // g, d)
            ok, want = shape == want_shape, str(list(want_shape))
        if not ok:
            raise ValueError(
                f"QuantizedKV: `scale` for granularity {self.granularity!r} must be {want}, got {list(shape)}"
            )

    def clone(self) -> QuantizedKV:
        """A copy owning its codes, scales and zero points (writes to the buffers it viewed no longer affect it)."""

        def copy(t):
            return None if t is None else t.clone()

        return dataclasses.replace(self, codes=self.codes.clone(), scale=copy(self.scale), zero=copy(self.zero))

    # -- shape ----------------------------------------------------------------------------------------------------
    @property
    def per_byte(self) -> int:
        return 8 // INT_FORMATS[self.format] if self.format in INT_FORMATS else 1

    @property
    def batch(self) -> int:
        return self.codes.shape[0]

    @property
    def heads(self) -> int:
        return self.codes.shape[1]

    @property
    def length(self) -> int:
        n = self.codes.shape[2]
        return n * self.per_byte if (self.per_byte > 1 and self.packing == "token") else n

    @property
    def head_dim(self) -> int:
        d = self.codes.shape[3]
        return d * self.per_byte if (self.per_byte > 1 and self.packing == "channel") else d

    @property
    def token_alignment(self) -> int:
        """Blocks read by `dequantize_block` must start (and, except at the end, stop) at multiples of this."""
        align = self.group_size if self.granularity == "channel" else 1
        if self.per_byte > 1 and self.packing == "token":
            align = math.lcm(align, self.pack_block)
        return align

    @property
    def shifts(self) -> tuple[int, ...]:
        """Bit offset of packed value i within a byte."""
        bits = 8 // self.per_byte
        if self.pack_order == "quanto":
            return tuple(bits * i for i in range(self.per_byte))
        return tuple(8 - bits * (i + 1) for i in range(self.per_byte))


# -- dequantization (torch) ---------------------------------------------------------------------------------------
def _fp8_to_float(codes: torch.Tensor, fmt: str) -> tuple[torch.Tensor, float]:
    """FP8 bits as float32 and the factor they are off by. On CPU the bits go through float16 with integer ops
    (torch's scalar float8 conversion is ~3 ns per value there): E4M3 shifted into float16 is the value x 2^-8
    (exponent bias 7 vs 15, subnormals included), E5M2 is the upper byte of float16 (exact)."""
    if codes.device.type != "cpu":
        return codes.view(FP8_FORMATS[fmt]).float(), 1.0
    if fmt == "fp8_e5m2":
        return (codes.to(torch.int16) << 8).view(torch.float16).float(), 1.0
    # int8 (sign-extended) * 128 in int16: the sign lands in bits 15 and 14, exponent-mantissa in 13..7; clear bit 14
    half = ((codes.view(torch.int8).to(torch.int16) * 128) & -16385).view(torch.float16)
    return half.float(), 256.0


def _unpack(kv: QuantizedKV, start: int, end: int) -> torch.Tensor:
    """Integer codes of tokens [start, end) as uint8 [B, H, end - start, D]."""
    p = kv.per_byte
    if p == 1:
        return kv.codes[:, :, start:end]
    mask = (1 << (8 // p)) - 1
    if kv.packing == "channel":
        packed = kv.codes[:, :, start:end]
        return torch.stack([(packed >> s) & mask for s in kv.shifts], -2).flatten(-2)
    blocks = (end - start) // kv.pack_block
    packed = kv.codes[:, :, start // p : end // p].unflatten(2, (blocks, kv.pack_block // p))
    return torch.stack([(packed >> s) & mask for s in kv.shifts], 3).flatten(2, 4)


def dequantize_block(kv: QuantizedKV, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of `kv` as float32 [B, H, end - start, D]. `start` must be a multiple of
    `kv.token_alignment`, and `end` too unless it is `kv.length`."""
    align = kv.token_alignment
    if start % align or (end % align and end != kv.length) or not 0 <= start <= end <= kv.length:
        raise ValueError(
            f"dequantize_block: tokens [{start}, {end}) must lie within the run of {kv.length} and "
            f"start (and end, unless it is {kv.length}) at multiples of {align}"
        )
    if kv.format == "none":
        x = kv.codes[:, :, start:end].float()
        return x if kv.bias is None else x + kv.bias.float()
    factor = 1.0
    if kv.format in FP8_FORMATS:
        x, factor = _fp8_to_float(kv.codes[:, :, start:end], kv.format)
    else:
        x = _unpack(kv, start, end).float()
    if kv.granularity == "token":
        scale, zero = kv.scale[:, :, start:end], None if kv.zero is None else kv.zero[:, :, start:end]
        groups = scale.shape[-1]
        x = x.unflatten(-1, (groups, kv.head_dim // groups))
        scale, zero = scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1)
    elif kv.granularity == "channel":
        g = kv.group_size
        rows = slice(start // g, -(-end // g))
        scale, zero = kv.scale[:, :, rows], None if kv.zero is None else kv.zero[:, :, rows]
        x = x.unflatten(2, (scale.shape[2], g))
        scale, zero = scale.unsqueeze(3), None if zero is None else zero.unsqueeze(3)
    else:
        scale, zero = kv.scale, kv.zero
    scale = torch.exp2(scale.float()) if kv.scale_pow2 else scale.float()
    if factor != 1.0:
        scale = scale * factor
    if zero is not None:
        x = (x - zero.float()) * scale if kv.zero_is_code else x * scale + zero.float()
    else:
        x = x * scale
    x = x.reshape(kv.batch, kv.heads, end - start, kv.head_dim)
    return x if kv.bias is None else x + kv.bias.float()


def dequantize(kv: QuantizedKV) -> torch.Tensor:
    """The whole run as float32 [B, H, n, D] (the dense reference; attention kernels never call this)."""
    return dequantize_block(kv, 0, kv.length)
