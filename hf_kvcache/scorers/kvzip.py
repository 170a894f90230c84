"""KVzip (Kim et al., arXiv 2505.23416): a context token's score is the largest attention any query of the model's
reconstruction of the context gives it (query-agnostic).

The scores come from forwards of the model itself (the context repeated, teacher-forced, chunk by chunk:
hf_kvcache.caches.kvzip runs them, hf_kvcache.policies.kvzip.ReconstructionScoringPolicy collects the scores), so
only KVzipCache can drive this scorer: it hands the context's scores over (`context_scores` [B, Hkv, context]) before
the context is placed, once. Nothing is scored after the context (prompt mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Scorer, state


@dataclass(eq=False)
class KVzip(Scorer):
    """KVzip's scorer, named after its method as every scorer (`Reconstruction` up to 0.3.0: state files naming it
    load, see hf_kvcache.sharing.state): hands over the context's reconstruction scores it was given, once."""

    name: ClassVar[str] = "kvzip"
    reads: ClassVar[str] = "the model's own forwards (context reconstruction)"
    needs_model_forwards: ClassVar[bool] = True

    context_scores: torch.Tensor | None = state()  # [B, Hkv, context] float32, until the context is placed

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor:
        scores = self.context_scores
        if scores is None or scores.shape[-1] != real.shape[1] or view.used:
            raise RuntimeError("KVzip places one context whose reconstruction scores it was given, once.")
        self.context_scores = None
        return scores
