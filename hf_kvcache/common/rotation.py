"""Orthogonal rotations of the head dimension, applied to keys before they are quantized.

Attention logits only need q . k, and q . k = (q R) . (k R) for an orthogonal R. Rotating the stored keys by a
Hadamard matrix spreads their few large (outlier) channels over all channels, and the cache rotates each query the
same way instead of rotating keys back (one [D, D] product per query, not per cached token). Floating-point
rounding is relative to each value, so the error of q . k is ~ sum_i q_i^2 k_i^2: large when q and k put their
energy in the same few channels (they do, in RoPE models), ~ |q|^2 |k|^2 / D once both are spread. On SmolLM2
this cuts the KL divergence of an E4M3 cache 2.5-4x at the same bytes (docs/quantization.md; QuaRot, arXiv
2404.00456, rotates KV caches the same way).

    rotation_matrix("hadamard", 64)   # Sylvester Hadamard / sqrt(64): symmetric, orthogonal
    rotation_matrix("random", 96)     # a seeded random orthogonal matrix (any head size)
"""

from __future__ import annotations

import torch

ROTATIONS = ("none", "hadamard", "random")
RANDOM_SEED = 0


def hadamard_matrix(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix divided by sqrt(n) (n a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


def rotation_matrix(kind: str, head_dim: int) -> torch.Tensor | None:
    """[head_dim, head_dim] float32 orthogonal matrix for `kind`, or None for "none".

    "hadamard": the Sylvester Hadamard matrix when head_dim is a power of two; otherwise block-diagonal Hadamard
    blocks of the largest power of two dividing head_dim (e.g. 96 -> three 32 x 32 blocks).
    "random": the Q factor of a seeded Gaussian matrix (reproducible: same matrix for a given head_dim)."""
    if kind == "none":
        return None
    if kind == "hadamard":
        block = head_dim & -head_dim  # largest power of two dividing head_dim
        if block == 1:
            raise ValueError(
                f"key_rotation='hadamard' needs an even head_dim, got {head_dim}; use key_rotation='random'."
            )
        return torch.block_diag(*[hadamard_matrix(block)] * (head_dim // block))
    if kind == "random":
        generator = torch.Generator().manual_seed(RANDOM_SEED)
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()  # sign fix: a unique Q for the seed
    raise ValueError(f"`key_rotation` must be one of {ROTATIONS}, got {kind!r}.")


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ matrix in float32, back in x's dtype (the product itself adds no bfloat16 rounding)."""
    m = matrix if matrix.device == x.device else matrix.to(x.device)
    if x.dtype == torch.float32:  # (two dispatches fewer in every decode step of a float32 model)
        return x @ m
    return (x.float() @ m).to(x.dtype)
