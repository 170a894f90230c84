"""Random eviction, the baseline every scorer is measured against: each token a uniformly random key.

Each token gets a random key when it arrives and the host evicts the lowest, which picks uniformly among the
candidates. No attention scores are needed. The key is a hash of (seed, batch row, global KV head, stream index)
(`random_keys`): the same seed makes the same choices, and under tensor parallelism rank r's heads (global heads from
`tensor_parallel.head_offset`) make exactly the choices one process makes for them. No generator state: it compiles
and runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.tensor_parallel import SINGLE_PROCESS, TensorParallel
from ..common.validation import require_int
from .base import Scorer, bound, state

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mix32(x):
    """A 32-bit integer finaliser (xorshift-multiply, as in splitmix/murmur) on int64 tensors or Python ints holding
    values in [0, 2**32). The multipliers are below 2**31, so no product overflows int64 (exact everywhere)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _MASK32
    return x ^ (x >> 16)


def random_keys(seed: int, rows: torch.Tensor, heads: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """Uniform float32 keys in [0, 1), a pure function of (seed, batch row, global KV head, stream index): counter
    based, so any token's key can be recomputed anywhere (every TP rank, any device, inside torch.compile) with
    tensor ops only. `rows`, `heads`, `stream` are int64 tensors broadcasting to the output shape."""
    h = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    for part in (rows, heads, stream):
        h = _mix32(((h ^ (part & _MASK32)) + _GOLDEN32) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / 2**24)  # 24 bits: exact in float32


@dataclass(eq=False)
class RandomKeys(Scorer):
    seed: int = 0
    tensor_parallel: TensorParallel = bound(SINGLE_PROCESS)  # draws keyed by global KV head under tensor parallelism

    name: ClassVar[str] = "random_eviction"
    row_independent: ClassVar[bool] = False
    reads: ClassVar[str] = "nothing (a hash of row, head and position)"
    compileable: ClassVar[bool] = True

    head_offset: int = state(0)

    def __post_init__(self):
        require_int("seed", self.seed, 0)

    def allocate(self, host, batch: int, heads: int, device) -> None:
        self.head_offset = self.tensor_parallel.head_offset(heads)

    def keys_of(self, stream: torch.Tensor) -> torch.Tensor:
        """Keys of the tokens with stream indices `stream` [B, H, n] (rows and heads by position in the tensor)."""
        batch, heads, _ = stream.shape
        rows = torch.arange(batch, device=stream.device)[:, None, None]
        global_heads = (torch.arange(heads, device=stream.device) + self.head_offset)[None, :, None]
        return random_keys(self.seed, rows, global_heads, stream)

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor:
        batch, q = real.shape
        stream = (seen + torch.arange(q, device=real.device)).expand(batch, host.scores.shape[1], q)
        return self.keys_of(stream)

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        return self.keys_of((seen_before + placement.src).expand(dest.shape))
