"""Half-precision scales widened to float32 by an op torch.compile cannot fuse (`hf_kvcache::widen_to_float32`).

Compiled decode on CPU: inductor fuses the dequantization of an FP8 store into the kernel that prepares SDPA's
inputs. When that kernel also reads per-token bfloat16 scales it vectorizes at bfloat16 width (32 lanes), and its
FP8 -> float32 conversion at that width is a slow path: measured on SmolLM2's layer shapes (2 x 3 heads x 640 slots x
64), ~740 us per layer with bfloat16 scales vs ~70 us with float32 scales. Widening the scales in an opaque call
(one small extern kernel per read: the scales are 1/64 of the codes) gives the dequantization kernel float32 inputs
only. Used only while compiling for the CPU: eager code and GPU code (Triton) do not have the problem.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hf_kvcache::widen_to_float32", mutates_args=())
def widen_to_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float()


@widen_to_float32.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def scales_to_float32(stored: torch.Tensor) -> torch.Tensor:
    """`stored.float()`, through the opaque op when compiling for the CPU (module docstring)."""
    if (
        stored.dtype in (torch.bfloat16, torch.float16)
        and stored.device.type == "cpu"
        and torch.compiler.is_compiling()
    ):
        return widen_to_float32(stored)
    return stored.float()
