"""KeyDiff: keep the keys least similar to the others.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments" (arXiv 2504.15364): tokens whose keys are distinctive tend to be the attended ones; no attention is
needed. Protocol (paper and kvpress KeyDiffPress): anchor = mean of the L2-normalised keys of the candidate set, per
KV head; score = -cosine(k, anchor); no recent window by default.

The anchor depends on the whole candidate set, so scores are recomputed whenever a selection is made: over the
stored tokens plus the new ones in a multi-token forward; over the stored tokens plus the new one before each
decode eviction (reading the stored keys: O(budget x head_dim) per step and view). Padding and empty slots are left
out of the anchor. No attention probabilities are ever computed for this policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Placement
from .scored import ScoredPolicy


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """keys [B, H, n, D], valid [B, H or 1, n] -> [B, H, n] float32: -cos(k, anchor), the anchor being the mean of
    the normalised valid keys of each row and head."""
    unit = F.normalize(keys.float(), p=2, dim=-1)
    weight = valid.expand(keys.shape[:3]).float()[..., None]
    anchor = (unit * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp_min(1.0)
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)


class KeyDiffPolicy(ScoredPolicy):
    def _candidates(self, view, n_stored: int, new_keys, new_valid):
        stored = view.read(n_stored)[0] if n_stored else new_keys[:, :, :0]
        keys = torch.cat((stored, new_keys.to(stored.dtype)), 2)
        valid = torch.cat((view.valid[..., :n_stored].expand(-1, keys.shape[1], -1), new_valid), -1)
        return keydiff_scores(keys, valid)

    def place_chunk(self, view, real, seen: int) -> Placement:
        keys, positions = view.incoming.keys, view.incoming.positions
        used = view.used
        scores = self._candidates(view, used, keys, real[:, None, :].expand(-1, keys.shape[1], -1))
        return self.select_chunk(view, real, seen, positions, scores[..., :used], scores[..., used:])

    def refresh(self, view, real: torch.Tensor) -> None:
        keys = view.incoming.keys
        c = self.capacity
        scores = self._candidates(view, c, keys, real[:, None, :].expand(-1, keys.shape[1], -1))[..., :c]
        self.scores[..., :c] = self.protect(scores, view.positions[..., :c])
