"""Which of a request's prompt tokens one layer keeps: the registry scorer's `score` (hf_kvcache.scorers.base, the
same scorer classes `generate` uses), on the prompt as the pages hold it, reduced to one score per token.

A page row holds every KV head of a token, so a layer keeps whole tokens: its KV heads' scores are reduced to one per
token as the scorer declares (`head_reduction`: the largest for the attention-based scores, KVzap's and SnapKV's: a
token some head attends to is kept; the mean for the key-geometry ones, KeyDiff's and Knorm's, whose per-head scales
differ), and every layer keeps the same number of tokens (a page is a block of every layer), each layer its own.
Budgets per head and per layer, as KVzipCache allots them, need pages of one (layer, head): head pages
(`kv_compress_layout` "head", hf_kvcache.paged.head_pages, chosen by hf_kvcache.paged.head_allotment).
"""

from __future__ import annotations

import functools

import torch

from ..scorers.base import Prompt, Scorer
from ..scorers.registry import SCORERS
from .compress_spec import CompressSpec


def prompt_scorer(spec: CompressSpec, layer_idx: int = 0, surrogate=None) -> Scorer | None:
    """The scorer of `spec.method` for layer `layer_idx`, with the spec's settings of the scorer's own fields
    (`spec.options`, e.g. SnapKV's `window` and `kernel`); a scorer reading attention inputs (KVzap) predicts with
    `surrogate`'s predictor for the layer. None for "sink_window" (nothing is scored)."""
    cls = SCORERS.get(spec.method)
    if cls is None:
        return None
    scorer = cls(**spec.options)
    if cls.needs_attention_inputs:
        scorer.predict = lambda hidden: surrogate.predict(layer_idx, hidden)
    return scorer


@functools.cache
def reads(method: str) -> tuple[str, ...]:
    """What `method`'s scorer reads of a prompt (`Scorer.prompt_reads`; nothing for "sink_window")."""
    cls = SCORERS.get(method)
    return () if cls is None else cls.prompt_reads


def token_scores(scorer: Scorer | None, prompt: Prompt) -> torch.Tensor | None:
    """One score per prompt token [P] (higher = keep): the scorer's per-head scores [Hkv, P] reduced as it declares;
    None without a scorer ("sink_window")."""
    if scorer is None:
        return None
    per_head = scorer.score(prompt).float()
    return per_head.amax(0) if scorer.head_reduction == "max" else per_head.mean(0)


def kept_positions(
    spec: CompressSpec, prompt: int, scores: torch.Tensor | None, device=None, kept: int | None = None
) -> torch.Tensor:
    """The positions [K] (ascending) a layer keeps of `prompt` tokens: the first `sinks`, the newest `window` and the
    best-scoring others (spec.protected), K = `kept` (None: spec.kept(prompt); chunk by chunk, the tokens held are
    fewer than the prompt tokens seen)."""
    kept = spec.kept(prompt) if kept is None else kept
    sinks, window = spec.protected(kept)
    device = scores.device if scores is not None else device
    positions = torch.arange(prompt, device=device)
    middle = kept - sinks - window
    chosen = [positions[:sinks], positions[prompt - window :] if window else positions[:0]]
    if middle:
        candidates = scores[sinks : prompt - window]
        chosen.append(sinks + candidates.topk(middle, sorted=False).indices)
    return torch.cat(chosen).sort().values
