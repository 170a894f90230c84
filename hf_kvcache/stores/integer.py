"""Integer storage (INT8/INT4/INT2, asymmetric) of keys or values, packed by optimum-quanto or hqq.

Groups: "token" = `group_size` consecutive channels of one token and KV head (KIVI values); "channel" = one channel
over a block of `group_size` consecutive tokens (KIVI keys). Each group has a scale and a zero point, stored in the
model's dtype (as transformers' QuantizedCache does).

Quantization (backends "torch" and "quanto"): zero = the group minimum, rounded down to the storage dtype (exactly
representable, so a large common offset costs no precision); scale = (max - zero) / (2^bits - 1) rounded up; values
round((x - zero) / scale) with quanto's `quantize_affine`. Every value is then within half a step of its original.
Backend "hqq" uses hqq's `Quantizer.quantize` (min-max start refined by its half-quadratic zero-point optimizer), and
stores hqq's scale and zero (in quantized units).

Packing (int4: 2 values per byte, int2: 4): the libraries pack along the first dimension of what they are given; we
hand them [values_per_byte, ...] so that each byte holds values of one token only: the packed layout of a token does
not depend on its neighbours, so tokens can be written into any slot and appended without repacking.
"""

from __future__ import annotations

import torch

from .quantization import SCALE_DTYPES, Codec, QuantSpec, round_down_to, round_up_to


def _quanto():
    import optimum.quanto  # noqa: F401  (registers torch.ops.quanto.*)
    from optimum.quanto.library.unpack import unpack as python_unpack
    from optimum.quanto.tensor.packed import pack_weights

    return pack_weights, python_unpack


def _hqq():
    from hqq.core.quantize import Quantizer

    return Quantizer


class IntegerCodec(Codec):
    def __init__(self, spec: QuantSpec):
        super().__init__(spec)
        self.bits = spec.bits
        self.qmax = 2**self.bits - 1
        self.per_byte = 8 // self.bits
        self.backend = spec.backend
        if self.backend == "quanto":
            self._pack_weights, self._python_unpack = _quanto()
        elif self.backend == "hqq":
            self._quantizer = _hqq()
        self._native_unpack_failed = False
        self.pack_block, self.token_pairs = 1, False

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.spec.scale_dtype] if self.spec.scale_dtype else self.dtype

    def _group(self) -> int:
        """Channels sharing a scale (token granularity)."""
        return self.spec.channel_group(self.head_dim)

    def _slot_shapes(self):
        d = self.head_dim
        groups = d // self._group() if self.spec.granularity == "token" else d
        return {
            "data": ((d,) if self.token_pairs else (d // self.per_byte,), torch.uint8),
            "scale": ((groups,), self.scale_dtype),
            "zero": ((groups,), self.scale_dtype),
        }

    def _per_block(self):
        return ("scale", "zero") if self.spec.granularity == "channel" else ()

    def _rows(self, name: str, slots: int) -> int:
        if name == "data" and self.token_pairs:
            return slots // self.per_byte
        return super()._rows(name, slots)

    # -- packing (the libraries' own) -------------------------------------------------------------------------
    # Two byte layouts, both position-independent (a byte never mixes tokens of different writes):
    # - channel pairs (any write pattern): a byte holds channels d, d + D/p, ... of one token;
    # - token pairs (append-only blocks of `pack_block` tokens, p | pack_block): a byte holds one channel of
    #   tokens i, i + block/p, ... of one block. Unpacking then yields long contiguous runs (block/p * D values)
    #   that are copied into place much faster than runs of D/p.
    def set_pack_block(self, tokens: int) -> None:
        """Called before `allocate` by an append-only store that writes whole blocks of `tokens` tokens."""
        self.pack_block = tokens
        self.token_pairs = self.per_byte > 1 and tokens % self.per_byte == 0 and tokens >= self.per_byte

    def _packer(self, rows: torch.Tensor) -> torch.Tensor:
        """rows uint8 [p, ...] -> packed [1, ...] by the backend library."""
        if self.backend == "quanto":
            return self._pack_weights(rows, self.bits)
        packing = self._quantizer.pack[self._quantizer.bit_to_packing[self.bits]]
        return packing(rows.reshape(self.per_byte, -1)).view((1,) + rows.shape[1:])

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """q uint8 [B, H, n, D] -> the stored bytes for these n slots."""
        p = self.per_byte
        if p == 1:
            return self._packer(q[None])[0] if self.backend == "hqq" else q
        b, h, n, d = q.shape
        if self.token_pairs:
            blocks = n // self.pack_block
            rows = q.unflatten(2, (blocks, p, self.pack_block // p)).permute(3, 0, 1, 2, 4, 5).contiguous()
            return self._packer(rows).reshape(b, h, n // p, d)
        rows = q.unflatten(-1, (p, d // p)).permute(3, 0, 1, 2, 4).contiguous()
        return self._packer(rows).reshape(b, h, n, d // p)

    def _unpack_rows(self) -> torch.Tensor:
        """The whole (contiguous) data buffer unpacked by the library: uint8 [p, numel of the buffer]."""
        flat = self.slot["data"].reshape(1, -1)
        if self.backend == "quanto":
            if not self._native_unpack_failed:
                try:
                    return torch.ops.quanto.unpack(flat, self.bits)  # quanto's CPU / CUDA kernel
                except Exception:  # extension could not be built here: quanto's own reference implementation
                    self._native_unpack_failed = True
            return self._python_unpack(flat, self.bits)
        return self._quantizer.unpack[self._quantizer.bit_to_packing[self.bits]](flat, dtype=torch.uint8)

    def _codes_into(self, out: torch.Tensor, n: int) -> None:
        """The integer codes of slots [0, n) cast into out [B, H, n, D] (natural layout)."""
        p = self.per_byte
        data = self.slot["data"]
        if p == 1:
            out.copy_(data[:, :, :n])
            return
        rows = self._unpack_rows()
        b, h, d = data.shape[0], data.shape[1], self.head_dim
        if self.token_pairs:
            blocks, cap_blocks = n // self.pack_block, self.capacity // self.pack_block
            rows = rows.view(p, b, h, cap_blocks, self.pack_block // p, d)[:, :, :, :blocks]
            target = out.unflatten(2, (blocks, p, self.pack_block // p)).permute(3, 0, 1, 2, 4, 5)
        else:
            rows = rows.view(p, b, h, self.capacity, d // p)[:, :, :, :n]
            target = out.unflatten(-1, (p, d // p)).permute(3, 0, 1, 2, 4)
        target.copy_(rows)

    # -- quantize ---------------------------------------------------------------------------------------------
    def _groups_view(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """x [B, H, n, D] viewed with one group per slice of the returned reduction dim."""
        if self.spec.granularity == "token":
            g = self._group()
            return x.unflatten(-1, (self.head_dim // g, g)), -1
        return x.unflatten(2, (x.shape[2] // self.block, self.block)), 3

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.float()
        xg, dim = self._groups_view(x)
        if self.backend == "hqq":
            return self._encode_hqq(x, xg, dim)
        lo, hi = xg.amin(dim, keepdim=True), xg.amax(dim, keepdim=True)
        sdtype = self.scale_dtype
        if sdtype == torch.float16:  # beyond the float16 range, values saturate
            lo = lo.clamp(-65504.0, 65504.0)
        zero = round_down_to(lo, sdtype)
        scale = round_up_to((hi - zero.float()) / self.qmax, sdtype)
        # at least the smallest normal number: subnormal scales are too coarse to cover the range (and all-zero
        # groups get a valid scale); at most the dtype's maximum (beyond: saturation)
        info = torch.finfo(sdtype)
        scale = scale.clamp(min=info.tiny, max=info.max)
        if self.backend == "quanto":
            q = torch.ops.quanto.quantize_affine(xg, self.bits, 0, None, scale.float(), -zero.float())
        else:
            q = ((xg - zero.float()) / scale.float()).round_().clamp_(0, self.qmax).to(torch.uint8)
        return self._encoded(q, scale.squeeze(dim), zero.squeeze(dim), x.shape)

    def _encode_hqq(self, x, xg, dim) -> dict[str, torch.Tensor]:
        # hqq works on 2-D [groups, group_size] with axis=1. Its thresholds are absolute (groups narrower than 1e-4
        # collapse, inverse scales clamp at 2e4), so each group is first divided by a power of two >= its largest
        # magnitude (exact), and the scale multiplied back: quantization becomes independent of the magnitude.
        moved = xg.movedim(dim, -1)
        rows = moved.reshape(-1, moved.shape[-1])
        mantissa, exponent = torch.frexp(rows.abs().amax(-1, keepdim=True))
        norm = torch.ldexp(torch.ones_like(mantissa), exponent.clamp(-125, 127))
        w_q, meta = self._quantizer.quantize(
            rows / norm,
            nbits=self.bits,
            channel_wise=True,
            group_size=None,
            optimize=True,
            axis=1,
            bitpack=False,
            compute_dtype=torch.float32,
            device=x.device,
        )
        group_shape = moved.shape[:-1]
        q = w_q.reshape(moved.shape).movedim(-1, dim).to(torch.uint8)
        scale = (meta["scale"].float() * norm).reshape(group_shape).to(self.scale_dtype)
        zero = meta["zero"].reshape(group_shape).to(self.scale_dtype)
        return self._encoded(q, scale, zero, x.shape)

    def _encoded(self, q, scale, zero, shape) -> dict[str, torch.Tensor]:
        q = q.reshape(shape)
        return {"data": self._pack(q), "scale": scale, "zero": zero}

    # -- dequantize -------------------------------------------------------------------------------------------
    def decode_into(self, out: torch.Tensor, n: int, workspace, bias: torch.Tensor | None = None) -> None:
        self._codes_into(out, n)
        d = self.head_dim
        if self.spec.granularity == "token":
            g = self._group()
            scale = self.slot["scale"][:, :, :n].float().unsqueeze(-1)
            zero = self.slot["zero"][:, :, :n].float().unsqueeze(-1)
            if g == d:  # [B, H, n, 1] against [B, H, n, D]
                scale, zero, target = scale[..., 0], zero[..., 0], out
            else:
                target = out.unflatten(-1, (d // g, g))
        else:
            m = n // self.block
            scale = self.slot["scale"][:, :, :m].float().unsqueeze(3)
            zero = self.slot["zero"][:, :, :m].float().unsqueeze(3)
            target = out.unflatten(2, (m, self.block))
        if self.backend == "hqq":  # (q - z) * s = q * s + (-z * s)
            zero = -zero * scale
        if bias is not None and self.spec.granularity == "channel":
            zero, bias = zero + bias.unsqueeze(2), None  # per channel, like the offsets: fold it in (small tensor)
        if torch.compiler.is_compiling():  # (dynamo refuses out= views; inductor fuses this into one pass anyway)
            target.copy_(torch.addcmul(zero, target, scale))
        elif target.dim() == 4 or self.spec.granularity == "channel":
            torch.addcmul(zero, target, scale, out=target)  # one pass (well vectorised for these shapes)
        else:  # scales broadcast within channel groups: in-place ops are much faster than addcmul here
            target.mul_(scale).add_(zero)
        if bias is not None:
            out.add_(bias)
