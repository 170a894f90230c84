"""KeyDiff (Park et al., arXiv 2504.15364): keep the keys least similar to the others.

Tokens whose keys are distinctive tend to be the attended ones; no attention is needed. Protocol (paper and kvpress
KeyDiffPress): anchor = mean of the L2-normalised keys of the candidate set, per KV head; score = -cosine(k, anchor).

The anchor depends on the whole candidate set, so scores are recomputed whenever a selection is made: over the
stored tokens plus the new ones in a multi-token forward; over the stored tokens plus the new one before each decode
selection (reading the stored keys: O(budget x head_dim) per step). Padding and empty slots are left out of the
anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import CandidateScorer, Prompt


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """keys [B, H, n, D], valid [B, H or 1, n] -> [B, H, n] float32: -cos(k, anchor), the anchor being the mean of
    the normalised valid keys of each row and head."""
    unit = F.normalize(keys.float(), p=2, dim=-1)
    weight = valid.expand(keys.shape[:3]).float()[..., None]
    anchor = (unit * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1.0)
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)


def stored_and_incoming(view, real: torch.Tensor, n_stored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys [B, H, n_stored + q, D] of the first `n_stored` slots then the incoming tokens, and their validity."""
    keys = view.incoming.keys
    stored = view.read(n_stored)[0] if n_stored else keys[:, :, :0]
    candidates = torch.cat((stored, keys.to(stored.dtype)), 2)
    heads = keys.shape[1]
    valid = torch.cat((view.valid[..., :n_stored].expand(-1, heads, -1), real[:, None].expand(-1, heads, -1)), -1)
    return candidates, valid


@dataclass(eq=False)
class KeyDiff(CandidateScorer):
    name: ClassVar[str] = "keydiff"
    reads: ClassVar[str] = "keys (the stored ones again at each selection)"
    prompt_reads: ClassVar[tuple[str, ...]] = ("keys",)
    head_reduction: ClassVar[str] = "mean"

    def score(self, prompt: Prompt) -> torch.Tensor:
        keys = prompt.keys[None]
        return keydiff_scores(keys, keys.new_ones(1, 1, keys.shape[2], dtype=torch.bool))[0]

    def candidates(self, host, view, real: torch.Tensor, n_stored: int, seen: int) -> torch.Tensor:
        return keydiff_scores(*stored_and_incoming(view, real, n_stored))
