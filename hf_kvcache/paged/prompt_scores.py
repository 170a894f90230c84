"""Which of a request's prompt tokens one layer keeps: the scores of hf_kvcache.scorers, on the prompt as the pages
hold it, reduced to one score per token.

A page row holds every KV head of a token, so a layer keeps whole tokens: its KV heads' scores are reduced to one per
token (the largest for the attention-based scores, KVzap's and SnapKV's: a token some head attends to is kept; the
mean for the key-geometry ones, KeyDiff's and Knorm's, whose per-head scales differ), and every layer keeps the same
number of tokens (a page is a block of every layer), each layer its own. Budgets per head or per layer, as KVzipCache
allots them, would need pages per head; they are not built.
"""

from __future__ import annotations

import torch

from ..scorers.base import group_mean
from ..scorers.keydiff import keydiff_scores
from ..scorers.knorm import knorm_scores
from ..scorers.snapkv import pool_before_window
from .compress_spec import CompressSpec

#: how a method's per-head scores [Hkv, P] become one per token
HEAD_REDUCTION = {"kvzap": "max", "snapkv": "max", "keydiff": "mean", "knorm": "mean"}


def snapkv_scores(keys: torch.Tensor, queries: torch.Tensor, scaling: float, kernel: int) -> torch.Tensor:
    """keys [Hkv, P, D] (as attention reads them), queries [Hq, w, D] of the prompt's last w tokens -> [Hkv, P]: the
    window's mean softmax attention (causal within the window), mean over each KV group's query heads, pooled
    (`kernel`) over the tokens before the window (SnapKV, hf_kvcache.scorers.snapkv)."""
    heads, prompt = keys.shape[0], keys.shape[1]
    q_heads, w = queries.shape[0], queries.shape[1]
    expanded = keys.float().repeat_interleave(q_heads // heads, dim=0)  # [Hq, P, D]
    logits = queries.float() @ expanded.transpose(1, 2) * scaling  # [Hq, w, P]
    position = torch.arange(prompt, device=keys.device)
    query_position = prompt - w + torch.arange(w, device=keys.device)
    logits = logits.masked_fill(position[None, None, :] > query_position[None, :, None], float("-inf"))
    votes = group_mean(logits.softmax(-1).mean(1)[None], heads)  # [1, Hkv, P]
    stream = position.expand(1, heads, prompt)
    valid = torch.ones_like(stream, dtype=torch.bool)
    return pool_before_window(votes, stream, valid, prompt - 1, w, kernel)[0]


def token_scores(
    spec: CompressSpec,
    keys: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
    predicted: torch.Tensor | None = None,
    scaling: float = 1.0,
) -> torch.Tensor | None:
    """One score per prompt token [P] for `spec.method` (higher = keep), from what the method reads: the prompt's
    keys [Hkv, P, D], the last queries [Hq, w, D] (snapkv), KVzap's predicted log scores [Hkv, P]; None for
    "sink_window" (nothing is scored)."""
    method = spec.method
    if method == "sink_window":
        return None
    if method == "kvzap":
        per_head = predicted
    elif method == "knorm":
        per_head = knorm_scores(keys[None])[0]
    elif method == "keydiff":
        per_head = keydiff_scores(keys[None], torch.ones(1, 1, keys.shape[1], dtype=torch.bool, device=keys.device))[0]
    else:
        per_head = snapkv_scores(keys, queries, scaling, spec.kernel)
    per_head = per_head.float()
    return per_head.amax(0) if HEAD_REDUCTION[method] == "max" else per_head.mean(0)


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
