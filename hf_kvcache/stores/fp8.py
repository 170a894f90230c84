"""FP8 storage (E4M3 or E5M2) of keys or values with a scale per tensor, KV head, token (or channel group of a token),
or per channel over a block of tokens.

Dynamic scales (token, channel) are amax / fmax, rounded up to `scale_dtype` (bfloat16 by default: 2 bytes per
group), so the largest value of each group lands at fmax (within the scale's rounding) and is stored almost exactly;
every other value gets FP8 rounding only (relative 2^-4 for E4M3 normal values, 2^-3 for E5M2). With scale_dtype
"e8m0" the scale is a power of two in one byte (OCP microscaling): division is exact but the largest value lands
anywhere in [fmax / 2, fmax]. Fixed scales (tensor, head) are float32: calibrated (static) or taken from the first
write (warm-up); larger values later saturate at +-fmax * scale. Under tensor parallelism (a rank holds a shard of
the KV heads) calibrated per-head scales are sliced to the rank's heads and a "tensor" warm-up scale is the maximum
over the ranks, so every rank quantizes as one process would (see hf_kvcache.common.tensor_parallel).

Dequantization on CPU avoids torch's scalar float8 -> float conversion (about 3 ns per value): the FP8 bits are moved
into float16 bits with integer ops (vectorised), then one multiply by the scale writes the output.
"""

from __future__ import annotations

import math

import torch

from ..common.tensor_parallel import SINGLE_PROCESS, TensorParallel
from ..kernels import cpu_encode
from .opaque_widen import scales_to_float32
from .quantization import FP8_DTYPES, SCALE_DTYPES, Codec, QuantSpec

EXP_MIN, EXP_MAX = -126, 119  # 2^(e + 8) stays a normal float32


def pow2_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """Smallest e with ratio <= 2^e, as int8, for ratio >= 0 (frexp is exact, unlike ceil(log2))."""
    mantissa, exponent = torch.frexp(ratio)
    e = exponent - (mantissa == 0.5).to(exponent.dtype)
    return e.clamp_(EXP_MIN, EXP_MAX).to(torch.int8)


def fp8_as_half(data: torch.Tensor, fp8_dtype: torch.dtype, scratch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """FP8 `data` as float16 values in `scratch` (int16, same shape) and the factor they are off by:
    E4M3 -> float16 bits (sign << 15 | exponent-mantissa << 7) is the value times 2^-8 (exponent bias 7 vs 15),
    subnormals included; E5M2 is the upper byte of float16, exact.

    Every step works in place on `scratch` (a workspace buffer): a mixed-dtype op (int8 * int16) would first copy
    its int8 input into a fresh int16 temporary on CPU, one more pass over the region and a new allocation."""
    if fp8_dtype == torch.float8_e4m3fn:
        # int8 sign-extended to int16, times 128: the sign lands in bits 15 and 14, exponent-mantissa in 13..7
        scratch.copy_(data.view(torch.int8))
        scratch.mul_(128)
        scratch.bitwise_and_(-16385)  # clear bit 14 (0xBFFF)
        return scratch.view(torch.float16), 256.0
    scratch.copy_(data.view(torch.uint8))
    scratch.bitwise_left_shift_(8)
    return scratch.view(torch.float16), 1.0


class FP8Codec(Codec):
    #: set by the store at allocation: under tensor parallelism, static per-head scales (given for all the model's KV
    #: heads) are sliced to this rank's heads, and the warm-up scale of granularity "tensor" is the max over all ranks
    tensor_parallel: TensorParallel = SINGLE_PROCESS

    def __init__(self, spec: QuantSpec):
        super().__init__(spec)
        self.fp8_dtype = FP8_DTYPES[spec.format]
        self.fmax = torch.finfo(self.fp8_dtype).max
        self.scale: torch.Tensor | None = None  # fixed scale (tensor/head granularity), float32

    # -- layout -----------------------------------------------------------------------------------------------
    @property
    def pow2(self) -> bool:
        return self.spec.scale_dtype == "e8m0"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.int8 if self.pow2 else SCALE_DTYPES[self.spec.scale_dtype or "bfloat16"]

    def _slot_shapes(self):
        d = self.head_dim
        shapes = {"data": ((d,), torch.uint8)}  # FP8 bits (uint8: CPU scatter/index ops lack float8)
        if self.spec.granularity == "token":
            shapes["scale"] = ((d // self.spec.channel_group(d),), self.scale_dtype)
        elif self.spec.granularity == "channel":
            shapes["scale"] = ((d,), self.scale_dtype)
        return shapes

    def _per_block(self):
        return ("scale",) if self.spec.granularity == "channel" else ()

    def _dynamic_scale(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored scale, scale to divide by) for groups with maximum magnitude `amax`."""
        if self.pow2:
            exp = pow2_exponent(amax / self.fmax)
            return exp, torch.exp2(exp.float())
        dtype = self.scale_dtype
        if dtype == torch.float32:
            scale = amax / self.fmax
        else:  # rounded up to the storage dtype (see round_up_to), in one multiply
            scale = (amax * ((1.0 + torch.finfo(dtype).eps) / self.fmax)).to(dtype)
        info = torch.finfo(dtype)
        scale = scale.clamp_(min=info.tiny, max=info.max)  # all-zero groups; beyond the range: saturation
        return scale, scale

    def _stored_scale(self, stored: torch.Tensor, factor: float) -> torch.Tensor:
        if self.pow2:
            return torch.exp2(stored.float() + math.log2(factor))
        return scales_to_float32(stored) * factor

    def set_scale(self, scale) -> None:
        """Fix the scale (tensor/head granularity): a float, or one float per KV head."""
        if self.spec.granularity not in ("tensor", "head"):
            raise ValueError(f"static scales need granularity 'tensor' or 'head', not {self.spec.granularity!r}")
        scale = torch.as_tensor(scale, dtype=torch.float32).flatten()
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"FP8 scales must be finite and positive, got {scale.tolist()}")
        if self.spec.granularity == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"granularity 'tensor' takes one scale, got {scale.numel()}")
            self.scale = scale.view(1, 1, 1, 1)
        else:
            self.scale = scale.view(1, -1, 1, 1)
        self.shared = {"scale": self.scale}

    def allocate(self, batch, heads, head_dim, capacity, dtype, device) -> None:
        super().allocate(batch, heads, head_dim, capacity, dtype, device)
        if self.scale is not None:
            tp = self.tensor_parallel
            if self.spec.granularity == "head" and self.scale.shape[1] == tp.kv_heads != heads and tp.sharded(heads):
                offset = tp.head_offset(heads)  # scales for all the model's heads: keep this rank's
                self.scale = self.scale[:, offset : offset + heads]
            if self.spec.granularity == "head" and self.scale.shape[1] != heads:
                raise ValueError(f"{self.scale.shape[1]} static head scales for a layer with {heads} KV heads")
            self.scale = self.scale.to(device)
            self.shared = {"scale": self.scale}

    def reserve_scratch(self, workspace) -> None:
        if torch.device(self.device).type == "cpu":  # (decode_into's bit route: CPU only)
            self._scratch(workspace, self.slot["data"].shape, self.device)

    @staticmethod
    def _scratch(workspace, shape, device) -> torch.Tensor:
        """int16 scratch of `shape` for `fp8_as_half`."""
        return workspace.get("fp8_scratch", tuple(shape), torch.int16, device)

    # -- quantize ---------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.float()
        gran = self.spec.granularity
        if gran == "token":
            g = self.spec.channel_group(self.head_dim)
            xg = x.unflatten(-1, (self.head_dim // g, g))
            stored, scale = self._dynamic_scale(torch.linalg.vector_norm(xg, math.inf, -1))
            q = xg / scale.unsqueeze(-1)
            return {
                "data": q.clamp_(-self.fmax, self.fmax).to(self.fp8_dtype).flatten(-2).view(torch.uint8),
                "scale": stored,
            }
        if gran == "channel":
            xb = x.unflatten(2, (x.shape[2] // self.block, self.block))
            stored, scale = self._dynamic_scale(xb.abs().amax(3))
            q = xb / scale.unsqueeze(3)
            return {
                "data": q.clamp_(-self.fmax, self.fmax).to(self.fp8_dtype).flatten(2, 3).view(torch.uint8),
                "scale": stored,
            }
        if self.scale is None:  # warm-up: the first write fixes the scale
            dims = (0, 2, 3) if gran == "head" else (0, 1, 2, 3)
            amax = x.abs().amax(dim=dims, keepdim=True)
            if gran == "tensor":  # one scale for the layer: the max over every rank's heads (no-op unsharded)
                self.tensor_parallel.all_reduce_max(amax, x.shape[1])
            self.scale = (amax / self.fmax).clamp_(min=torch.finfo(torch.float32).tiny)
            self.shared = {"scale": self.scale}
        return {"data": (x / self.scale).clamp_(-self.fmax, self.fmax).to(self.fp8_dtype).view(torch.uint8)}

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor | None, slot: int) -> bool | None:
        """`encode` + `put` of a decode step's tokens at slots [slot, slot + n) in one native call on CPU
        (hf_kvcache.kernels.cpu_encode, bit for bit the same), keys in rows [0, B) and values (a joint codec) in
        [B, 2B): True when written; False when an input is not finite (nothing written); None when the native
        write does not take this layout or these tensors (then encode and put)."""
        if self.spec.granularity != "token" or self.pow2:
            return None
        data, scale = self.slot["data"], self.slot["scale"]
        if cpu_encode.unsupported(keys, data, scale) is not None:
            return None
        return cpu_encode.fp8_write_tokens(
            keys, values, data, scale, slot, self.fp8_dtype, self.spec.channel_group(self.head_dim)
        )

    # -- dequantize -------------------------------------------------------------------------------------------
    def decode_into(self, out: torch.Tensor, n: int, workspace, bias: torch.Tensor | None = None) -> None:
        data = self.slot["data"][:, :, :n]
        gran = self.spec.granularity
        if out.device.type == "cpu" and not torch.compiler.is_compiling():
            # (compiled code takes the native conversion: inductor's CPU code for this bit trick next to bfloat16
            # scales was measured wrong, and it vectorises the native one itself)
            scratch = self._scratch(workspace, data.shape, out.device)
            half, factor = fp8_as_half(data, self.fp8_dtype, scratch)
            out.copy_(half)  # float16 -> output dtype, then one in-place multiply (faster than a mixed-dtype mul)
        else:  # native conversion kernels are fast on accelerators
            out.copy_(data.view(self.fp8_dtype))
            factor = 1.0
        if gran == "token":
            g = self.spec.channel_group(self.head_dim)
            scale = self._stored_scale(self.slot["scale"][:, :, :n], factor)
            if g == self.head_dim:  # [B, H, n, 1] against [B, H, n, D]
                target = out
            else:  # scales broadcast within channel groups: in-place ops are much faster than addcmul here
                out.unflatten(-1, (self.head_dim // g, g)).mul_(scale.unsqueeze(-1))
                if bias is not None:
                    out.add_(bias)
                return
        elif gran == "channel":
            m = n // self.block
            scale = self._stored_scale(self.slot["scale"][:, :, :m], factor).unsqueeze(3)
            target = out.unflatten(2, (m, self.block))
            bias = None if bias is None else bias.unsqueeze(2)
        else:
            scale, target = self.scale * factor, out
        if bias is None:
            target.mul_(scale)
        elif torch.compiler.is_compiling():  # (dynamo refuses out= views; inductor fuses this into one pass anyway)
            target.copy_(torch.addcmul(bias, target, scale))
        else:  # x * scale + bias in one pass
            torch.addcmul(bias, target, scale, out=target)
