"""FP8 quantization of a decode step's new tokens straight into a store's slot buffers, on CPU (`cpu_encode.cpp`,
built with the native attention kernel, hf_kvcache.kernels.cpu_blockwise).

For one token per row and head, the torch path (encode, then put) is a dozen eager ops of a few hundred numbers
each: ~100 us of dispatch per layer and decode step for ~1 us of arithmetic. The native write does the same
arithmetic with the same roundings, bit for bit (tests/test_cpu_encode.py), in one call. Layout: one scale per
token and channel group (`granularity="token"`), stored as float32, bfloat16 or float16 (not e8m0 exponents); any
float input dtype. Eager CPU code only: under torch.compile the torch path is traced.
"""

from __future__ import annotations

import torch

from . import cpu_blockwise

_FP8_IDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(keys: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> str | None:
    """Why the native write cannot take these tensors here (None: it can); builds the extension on first use."""
    if scale.dtype not in _SCALE_DTYPES or not keys.is_floating_point():
        return (
            f"scales {scale.dtype} / inputs {keys.dtype}: it takes float inputs and float32 / bfloat16 / float16 scales"
        )
    return cpu_blockwise.unusable(keys, data, scale)


def fp8_write_tokens(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    data: torch.Tensor,
    scale: torch.Tensor,
    slot: int,
    fp8_dtype: torch.dtype,
    group: int,
) -> bool:
    """Quantize keys (and values) [B, H, n, D] into slots [slot, slot + n) of rows [0, B) (values: [B, 2B)) of the
    slot buffers `data` [R, H, capacity, D] (uint8 FP8 bits) and `scale` [R, H, capacity, D / group], as
    `FP8Codec.encode` + `put` would. Returns False, having written nothing, when an input is not finite (the caller
    raises its own error). Call `unsupported` first."""
    fmax = torch.finfo(fp8_dtype).max
    up = (1.0 + torch.finfo(scale.dtype).eps) / fmax  # (the torch path's one multiply, as its scalar)
    return cpu_blockwise._module.fp8_write_tokens(
        keys.contiguous(),
        None if values is None else values.contiguous(),
        data,
        scale,
        int(slot),
        _FP8_IDS[fp8_dtype],
        int(group),
        fmax,
        up,
    )


#: the native pass is one thread, meant for a decode step's few numbers (measured: 0.3 vs 7.3 us for torch's check
#: at 384 numbers, 38 vs 95 us at 64K); larger inputs (prefill chunks) keep torch's check
FINITE_NATIVE_MAX = 1 << 16


def tensors_finite(keys: torch.Tensor, values: torch.Tensor | None) -> bool | None:
    """Whether every element of keys (and values) is finite, in one native call for a decode step's few numbers on
    CPU (the stores' check before quantizing; torch's is five dispatches); None where it does not apply (other
    devices, compiled code, large inputs, non-float tensors, no native build): check with torch then."""
    if (
        keys.numel() > FINITE_NATIVE_MAX
        or not keys.is_floating_point()
        or (values is not None and not values.is_floating_point())
    ):
        return None
    if cpu_blockwise.unusable(*(t for t in (keys, values) if t is not None)) is not None:
        return None
    return cpu_blockwise._module.tensors_finite(keys, values)


__all__ = ["FINITE_NATIVE_MAX", "fp8_write_tokens", "tensors_finite", "unsupported"]
