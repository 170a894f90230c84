"""TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104): keep what the last query attends to.

Token Omission Via Attention: at each step the token with the lowest attention from the current query is dropped,
the attention averaged over all heads of the layer (the paper found the layer-wide average better than per-head
choices). Protocol (paper and kvpress TOVAPress): score = softmax attention of the last query, mean over every query
head, so all KV heads keep the same tokens; the newest token is kept (`recent` = 1, TOVACache's default).

A multi-token forward is scored by its last query alone (`attention_window` = 1, left padding weighted out); in
decode the scores are replaced by each step's query attention, and the victim of a step is chosen before its
attention, i.e. by the previous query (the step attends to exactly `budget` tokens, where TOVA attends to budget + 1
and then drops one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Scorer


def tova_scores(column_scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Attention of the last query [B, Hq, kv] -> [B, Hkv, kv]: the mean over all query heads, for every KV head."""
    return column_scores.float().mean(1, keepdim=True).expand(-1, kv_heads, -1)


@dataclass(eq=False)
class TOVA(Scorer):
    name: ClassVar[str] = "tova"
    reads: ClassVar[str] = "the last query's attention"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self):
        self.attention_window = 1  # the last query's attention only

    def observe(self, host, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        scores = tova_scores(column_scores, view.valid.shape[1])
        n = scores.shape[-1] if view.pending is None else view.used
        host.scores[..., :n] = scores[..., :n]  # replaced by each forward's last query
        return None if view.pending is None else scores
