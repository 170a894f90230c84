"""KVzap (kvpress, arXiv 2601.07891): a token's score is KVzip's, predicted by a small trained model from the layer's
attention input hidden states (hf_kvcache.scorers.kvzap_surrogate), so no reconstruction forwards are run.

The score is query-agnostic and fixed when the token enters the cache: one surrogate evaluation per token and layer
(a [d -> Hkv] linear map or a small MLP), in prompt mode and during decode (`compress="always"`). The hidden states
come from hooks on the attention modules, which only its cache installs (hf_kvcache.caches.kvzap): `hidden` is bound
to a callable giving this layer's attention input of the current forward, `predict` to the surrogate's predictor
for this layer. A context placed at once (the prompt, allotted over the model) is handed its scores
(`context_scores`) by the cache, as KVzip's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Prompt, Scorer, bound, state


@dataclass(eq=False)
class KVzap(Scorer):
    name: ClassVar[str] = "kvzap"
    reads: ClassVar[str] = "the layer's attention input hidden states (a surrogate trained on KVzip's scores)"
    needs_attention_inputs: ClassVar[bool] = True
    prompt_reads: ClassVar[tuple[str, ...]] = ("arrived",)

    hidden: object = bound()  # () -> this layer's attention input [B, q, d] of the current forward
    predict: object = bound()  # hidden [B, q, d] -> predicted log scores [B, Hkv, q] float32

    context_scores: torch.Tensor | None = state()  # a placed context's scores, handed over once by the cache
    _chunk_scores: torch.Tensor | None = state()  # a chunk's new tokens' scores, until they are written

    def _new_scores(self) -> torch.Tensor:
        if self.hidden is None:
            raise RuntimeError("KVzap scores the attention inputs its cache hooks (KVzapCache): none are bound.")
        return self.score_arrivals(self.hidden())

    def score_arrivals(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.predict is None:
            raise RuntimeError("KVzap scores with a surrogate's predictor: none is bound.")
        return self.predict(hidden)

    def score(self, prompt: Prompt) -> torch.Tensor:
        return prompt.arrived  # fixed when each token arrived (score_arrivals)

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor:
        scores = self.context_scores
        if scores is not None and scores.shape[-1] == real.shape[1]:
            self.context_scores = None
        else:
            scores = self._new_scores()
        self._chunk_scores = scores
        return scores

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        if self._chunk_scores is None:  # decode: the new token's own prediction, fixed from now on
            return self._new_scores()
        scores = self._chunk_scores.gather(2, placement.src.expand(dest.shape))
        self._chunk_scores = None
        return scores
