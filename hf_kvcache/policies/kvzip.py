"""KVzip: keep the context tokens the model needs to reconstruct the context (query-agnostic).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv 2505.23416): after the
context is prefilled, the model is asked to repeat it ("Repeat the previous context exactly." followed by the
context itself, teacher-forced); a context token's importance, per KV head, is the largest attention any query of
that reconstruction (any query head of the KV group) gives it. Long contexts are reconstructed chunk by chunk
(each chunk's request ends with the last tokens of the chunk before it), and a chunk is scored by a softmax
restricted to the sinks, the chunk and the reconstruction tokens, so memory stays bounded by the chunk
(kvpress KVzipPress's protocol, chunk 2048, 4 sinks never evicted).

Two policies, one per phase of a layer (hf_kvcache.caches.kvzip runs the phases):
- `ReconstructionScoringPolicy` while the context is collected and reconstructed: every token kept (the layer
  grows); during a reconstruction forward it takes the bridge's max-attention column scores (`attention_reduce`
  "max", `score_columns` the restricted softmax's columns) into `context_scores` for the chunk's columns;
- `ScoredPolicy` with the `KVzip` scorer (hf_kvcache.scorers.kvzip) when the context is placed at its
  budget: the scores for the context are the reconstruction's, uniform per head or head-adaptive (the paper allots
  by score across heads: `head_budget="adaptive"`), the layer's pool given (`total`) when the model allots its
  budget over the layers too (`layer_budgets`).
"""

from __future__ import annotations

import torch

from .keep_all import KeepAllPolicy


def layer_budgets(scores: list[torch.Tensor], budgets: list[int], heads: int) -> list[int]:
    """KVzip's model-wide allotment: `scores` per layer [B, Hkv, n] (+inf: must stay, -inf: padding), `budgets` the
    layers' per-head budgets. The best `sum(budgets) x heads` (head, token) pairs per row over all layers are kept;
    a layer's pool is its share of them, averaged over the rows (exact for one row), at least one token per head
    (taken from the largest share, so the shares add up to the model's budget)."""
    total = sum(budgets) * heads
    flat = torch.cat([part.flatten(1) for part in scores], 1)  # [B, sum of Hkv x n]
    chosen = flat.topk(min(total, flat.shape[1]), dim=-1).indices
    sizes = torch.tensor([part[0].numel() for part in scores], device=flat.device)
    layer_of = torch.repeat_interleave(torch.arange(len(scores), device=flat.device), sizes)
    counts = torch.bincount(layer_of[chosen].flatten(), minlength=len(scores)).double() / flat.shape[0]
    shares = [max(heads, int(round(c))) for c in counts.tolist()]
    largest = max(range(len(shares)), key=shares.__getitem__)
    shares[largest] = max(heads, shares[largest] - (sum(shares) - total))
    return shares


class ReconstructionScoringPolicy(KeepAllPolicy):
    """Keep every token; during a reconstruction forward (`begin_scoring`), record for each context column the
    largest attention the forward's queries gave it (max over the queries and the KV group's query heads)."""

    state, transient = ("context_scores",), ("targets", "score_columns")

    def __init__(self):
        super().__init__(None)
        self.context_scores: torch.Tensor | None = None  # [B, Hkv, context] float32
        self.targets: torch.Tensor | None = None  # [B, context] bool: the columns this forward scores
        self.score_columns = None

    @property
    def needs_attention(self) -> bool:
        return self.targets is not None

    @property
    def may_have_holes(self) -> bool:  # while scoring, the bridge always hands the layer's validity, so the scores
        return self.targets is not None  # come from its one-pass attention (hf_kvcache.attention.scored)

    attention_reduce = "max"

    def begin_scoring(self, context: int, targets: torch.Tensor, score_columns: torch.Tensor) -> None:
        """The next forward reconstructs a chunk: score the `targets` [B, context] columns, each query's softmax
        restricted to `score_columns` [B, context + new tokens]."""
        if self.context_scores is None:
            self.context_scores = torch.zeros(targets.shape[0], self.heads, context, device=targets.device)
        self.targets, self.score_columns = targets, score_columns

    def end_scoring(self) -> None:
        self.targets = self.score_columns = None

    def allocate(self, batch: int, heads: int, device) -> None:
        self.heads = heads

    def observe(self, view, column_scores: torch.Tensor) -> None:
        batch, q_heads, _ = column_scores.shape
        context = self.context_scores.shape[-1]
        grouped = column_scores[..., :context].view(batch, self.heads, q_heads // self.heads, context).amax(2)
        targets = self.targets[:, None, :]
        self.context_scores = torch.where(targets, torch.maximum(self.context_scores, grouped), self.context_scores)
