"""TOVA: keep the tokens the last query attends to most.

Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104), Token Omission Via Attention: at each step the
token with the lowest attention from the current query is dropped, the attention being averaged over all heads of
the layer (the paper found the layer-wide average better than per-head choices). Protocol (paper and kvpress
TOVAPress): score = softmax attention of the last query, mean over every query head of the view, so all KV heads
keep the same tokens; the newest token is kept (`recent` = 1).

Here: a multi-token forward is scored by its last query alone (the bridge computes the attention of that one query:
`attention_window` = 1, left padding weighted out); in decode the scores are replaced by each step's query
attention, and the victim of a step is chosen before its attention, i.e. by the previous query (the step attends
to exactly `budget` tokens, where TOVA attends to budget + 1 and then drops one).
"""

from __future__ import annotations

import torch

from .scored import ScoredPolicy


def tova_scores(column_scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Attention of the last query [B, Hq, kv] -> [B, Hkv, kv]: the mean over all query heads, for every KV head."""
    return column_scores.float().mean(1, keepdim=True).expand(-1, kv_heads, -1)


class TOVAPolicy(ScoredPolicy):
    deferred = True
    needs_attention = True
    attention_window = 1

    def observe(self, view, column_scores: torch.Tensor) -> None:
        scores = tova_scores(column_scores, self.scores.shape[1])
        if view.pending is None:  # decode: the columns are the slots
            n = scores.shape[-1]
            self.scores[..., :n] = self.protect(scores, view.positions[..., :n])
            return
        used = view.used
        pending = view.pending
        real, positions, seen_before = pending.real, pending.positions, pending.seen_before
        view.commit(self.select_chunk(view, real, seen_before, positions, scores[..., :used], scores[..., used:]))
