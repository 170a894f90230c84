"""Knorm (Devoto et al., EMNLP 2024, arXiv 2406.11430): keep the keys with the smallest L2 norm.

Across models, tokens whose keys have a low L2 norm receive high attention, so keeping the low-norm keys approximates
keeping the attended ones without computing attention. Protocol (paper and kvpress KnormPress): score = -||k||_2 per
token and KV head, keys as cached (RoPE-rotated: the rotation does not change the norm). A token's score is fixed
when it arrives; no attention probabilities are ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Prompt, Scorer


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, n] float32: minus the L2 norm of each key."""
    return -keys.float().norm(dim=-1)


@dataclass(eq=False)
class Knorm(Scorer):
    name: ClassVar[str] = "knorm"
    reads: ClassVar[str] = "keys"
    prompt_reads: ClassVar[tuple[str, ...]] = ("keys",)
    head_reduction: ClassVar[str] = "mean"

    def score(self, prompt: Prompt) -> torch.Tensor:
        return knorm_scores(prompt.keys[None])[0]

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor:
        return knorm_scores(view.incoming.keys)

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        return knorm_scores(keys)  # fixed at arrival
