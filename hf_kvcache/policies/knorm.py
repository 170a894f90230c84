"""Knorm: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024, arXiv
2406.11430): across models, tokens whose keys have a low L2 norm receive high attention, so keeping the low-norm
keys approximates keeping the attended ones without computing attention. Protocol (paper and kvpress KnormPress):
score = -||k||_2 per token and KV head, keys as cached (RoPE-rotated: the rotation does not change the norm); no
recent window by default.

A token's score is fixed when it arrives, so decode needs no refresh and no attention probabilities are ever
computed for this policy.
"""

from __future__ import annotations

import torch

from .base import Placement
from .scored import ScoredPolicy


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, n] float32: minus the L2 norm of each key."""
    return -keys.float().norm(dim=-1)


class KnormPolicy(ScoredPolicy):
    def arrival_scores(self, view, keys: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return knorm_scores(keys)

    def place_chunk(self, view, real, seen: int) -> Placement:
        keys, positions = view.incoming.keys, view.incoming.positions
        used = view.used
        return self.select_chunk(view, real, seen, positions, self.scores[..., :used], knorm_scores(keys))
