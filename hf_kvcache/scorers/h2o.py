"""H2O (Zhang et al., arXiv 2306.14048): a token's score is the attention it has received, accumulated over queries.

Per KV head: the column scores of the query heads of each group are aggregated ("sum" by default, "mean" or "max"),
then added to the stored tokens' scores at every forward (float32). A new token starts at 0 and gains its first
score from the forward it arrives in (chunks) or from the next step's query (decode). Its host ranks by the
accumulated sum, or by its mean over the queries that saw the token (`H2OCache(attention_score="average")`,
kvpress's ObservedAttentionPress).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.validation import require_choice
from .base import Scorer

AGGREGATIONS = ("sum", "mean", "max")


def aggregate(column_scores: torch.Tensor, kv_heads: int, aggregation: str) -> torch.Tensor:
    """[B, Hq, kv] -> [B, Hkv, kv] over the query heads of each KV group."""
    batch, q_heads, kv = column_scores.shape
    grouped = column_scores.view(batch, kv_heads, q_heads // kv_heads, kv)
    if aggregation == "sum":
        return grouped.sum(2)
    if aggregation == "mean":
        return grouped.mean(2)
    return grouped.amax(2)


@dataclass(eq=False)
class H2O(Scorer):
    aggregation: str = "sum"

    name: ClassVar[str] = "h2o"
    reads: ClassVar[str] = "attention received"
    needs_attention: ClassVar[bool] = True
    compileable: ClassVar[bool] = True

    def __post_init__(self):
        require_choice("aggregation", self.aggregation, AGGREGATIONS)

    def observe(self, host, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        scores = aggregate(column_scores, view.valid.shape[1], self.aggregation)
        if view.pending is None:  # decode: the columns are the slots
            stored = host.scores[..., : scores.shape[-1]]
            stored += scores  # accumulated, in place (no write-back of the slice: one op fewer per layer and step)
            return None
        stored = host.scores[..., : view.used]
        stored += scores[..., : view.used]
        return scores
