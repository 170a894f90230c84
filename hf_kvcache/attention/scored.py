"""Softmax attention that also returns the probability each key column received, from the same pass.

    out, scores = scored_attention(query, key, value, valid, causal_tail, scaling)
    # out [B, q, Hq, Dv] (query dtype, the layout transformers' attention functions return), scores [B, Hq, kv] float32

The attention bridge uses it for policies that need attention scores (H2O and the other scorers): the output comes
from the same probabilities that are summed into the scores, so a forward costs one attention, not SDPA plus a
second pass that recomputes the probabilities.

Contract (equal to eager attention with the layer's validity mask, `hf_kvcache.attention.build_validity_mask`):
- logits = (query . key) * scaling, in the query dtype as eager attention computes them; `softcap * tanh(logits /
  softcap)` if `softcap` (Gemma 2); softmax in float32; `sinks` [Hq] are one extra logit per query head in each
  softmax denominator that no key receives (GPT-OSS);
- `valid` bool [B, Hkv or 1, kv] (None: every column): False columns are not attended;
- `causal_tail` (0 or q): the last q columns are the new tokens in order, causal among themselves, and each query
  always sees its own column (so no row is empty). With `causal_tail` = 0 every valid column is visible (decode);
- GQA: query head h reads KV head h // (Hq // Hkv);
- scores: the probability each column received, summed over the queries from `score_from` on, each weighted by
  `query_weight` [B, q] (e.g. 0 for padding queries); per query head, so a policy aggregates a KV group its way.
  With `reduce="max"`, the largest weighted probability any of those queries gave the column instead of the sum
  (KVzip's score); with `normalize_over` [B, kv] bool as well, each query's probabilities are first divided by their
  sum over those columns, i.e. a softmax restricted to them (KVzip's chunked reconstruction scores a chunk over the
  sinks, the chunk and the reconstruction tokens only).

Memory and work: queries are processed `chunk` at a time against the key columns they can see (with a causal tail,
chunk [s, e) sees only the first kv - q + e columns, so the masked upper triangle is never computed); each chunk's
softmax is exact (it spans every column the chunk sees), so nothing is recomputed. Extra memory is O(B x Hq x chunk
x kv), never [q, kv] for the whole prompt; the default chunk keeps one chunk's logits near `CHUNK_ELEMENTS` floats.
Chunk boundaries are Python integers from shapes: no host-device sync, and a decode step (q = 1, one chunk)
compiles with fullgraph.
"""

from __future__ import annotations

import torch

#: default size of one chunk's logits, in elements (B x Hq x chunk x kv): 4 MB of float32 (cache-sized on CPU)
CHUNK_ELEMENTS = 1 << 20


def default_chunk(batch: int, q_heads: int, kv: int) -> int:
    """Queries per chunk so that one chunk's logits hold about CHUNK_ELEMENTS elements (at least 16 queries)."""
    return max(16, CHUNK_ELEMENTS // max(1, batch * q_heads * kv))


REDUCTIONS = ("sum", "max")


def _check(query, key, value, valid, causal_tail, query_weight, score_from, chunk, reduce="sum", normalize_over=None):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"scored_attention: `query`, `key`, `value` must be 4-D [B, H, tokens, D], got "
            f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    batch, q_heads, q, _ = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    if q_heads % kv_heads or value.shape[1] != kv_heads or value.shape[2] != kv:
        raise ValueError(
            f"scored_attention: query heads ({q_heads}) must be a multiple of KV heads ({kv_heads}), and "
            f"values [H, kv] = {list(value.shape[1:3])} must match keys {[kv_heads, kv]}"
        )
    if causal_tail not in (0, q) or causal_tail > kv:
        raise ValueError(
            f"scored_attention: `causal_tail` must be 0 or the query length {q} (<= {kv} columns), got {causal_tail}"
        )
    if valid is not None and (
        valid.dtype != torch.bool
        or valid.dim() != 3
        or valid.shape[0] != batch
        or valid.shape[1] not in (1, kv_heads)
        or valid.shape[2] != kv
    ):
        raise ValueError(
            f"scored_attention: `valid` must be bool [B={batch}, Hkv={kv_heads} or 1, kv={kv}], got "
            f"{valid.dtype} {list(valid.shape)}"
        )
    if query_weight is not None and tuple(query_weight.shape) != (batch, q):
        raise ValueError(
            f"scored_attention: `query_weight` must be [B, q] = {[batch, q]}, got {list(query_weight.shape)}"
        )
    if not 0 <= score_from <= q:
        raise ValueError(f"scored_attention: `score_from` must be in [0, q={q}], got {score_from}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"scored_attention: `chunk` must be None or an int >= 1, got {chunk!r}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"scored_attention: `reduce` must be one of {REDUCTIONS}, got {reduce!r}")
    if normalize_over is not None and (
        reduce != "max" or normalize_over.dtype != torch.bool or tuple(normalize_over.shape) != (batch, kv)
    ):
        raise ValueError(
            f"scored_attention: `normalize_over` must be bool [B={batch}, kv={kv}] and needs "
            f"reduce='max', got {normalize_over.dtype} {list(normalize_over.shape)} with {reduce!r}"
        )


def _mask_chunk(logits, valid, causal_tail: int, start: int, end: int, kv: int) -> None:
    """Set the logits [B, Hkv, G, end - start, cols] of hidden columns to -inf in place. Columns before the chunk's
    diagonal block are hidden only by `valid`; the block [kv - causal_tail + start, cols) is causal among the new
    tokens (each query also sees its own column); columns after it were never computed."""
    cols = logits.shape[-1]
    block = kv - causal_tail + start if causal_tail else cols  # first column of the diagonal block
    if valid is not None and block > 0:  # (adding 0 / -inf: a third of the time of masked_fill_ with ~valid)
        logits[..., :block].add_(torch.where(valid[:, :, None, None, :block], 0.0, float("-inf")))
    if causal_tail:
        rows = torch.arange(end - start, device=logits.device)[:, None]
        column = torch.arange(cols - block, device=logits.device)
        visible = column <= rows
        if valid is not None:
            visible = (valid[:, :, None, None, block:cols] & visible) | (column == rows)
        logits[..., block:].masked_fill_(~visible, float("-inf"))


def scored_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    causal_tail: int,
    scaling: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    query_weight: torch.Tensor | None = None,
    score_from: int = 0,
    chunk: int | None = None,
    reduce: str = "sum",
    normalize_over: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, q, Hq, Dv] in the query dtype and column scores [B, Hq, kv] float32 (see the module
    docstring for the contract)."""
    _check(query, key, value, valid, causal_tail, query_weight, score_from, chunk, reduce, normalize_over)
    batch, q_heads, q, dim = query.shape
    kv_heads, kv, value_dim = key.shape[1], key.shape[2], value.shape[-1]
    groups = q_heads // kv_heads
    device = query.device
    if chunk is None:
        chunk = default_chunk(batch, q_heads, kv)
    grouped = query.view(batch, kv_heads, groups, q, dim)
    keys_t = key.transpose(-1, -2)  # [B, Hkv, D, kv]
    weight = None if query_weight is None else query_weight.to(device=device, dtype=torch.float32)
    sink = None if sinks is None else sinks.float().view(1, kv_heads, groups, 1, 1)
    single = q <= chunk  # one chunk (every decode step): its output and scores are the results, not copied into them
    out = None if single else torch.empty(batch, q, q_heads, value_dim, dtype=query.dtype, device=device)
    scores = None if single else torch.zeros(batch, q_heads, kv, dtype=torch.float32, device=device)
    for start in range(0, q, chunk):
        end = min(q, start + chunk)
        size = end - start
        cols = kv - causal_tail + end if causal_tail else kv  # the columns this chunk can see
        # the chunk's queries of a KV group as rows of one matrix: plain batched matmuls, keys never copied
        rows = grouped[:, :, :, start:end].reshape(batch, kv_heads, groups * size, dim)
        logits = torch.matmul(rows, keys_t[..., :cols]).float().view(batch, kv_heads, groups, size, cols)
        logits.mul_(scaling)
        if softcap:
            logits = torch.tanh(logits.div_(softcap)).mul_(softcap)
        _mask_chunk(logits, valid, causal_tail, start, end, kv)
        if sink is None:
            probs = torch.softmax(logits, dim=-1)
            if not causal_tail:  # a row with nothing visible is NaN there: zero output and scores (with a causal
                probs.nan_to_num_(0.0)  # tail every row sees its own column)
        else:  # attention sinks: one more logit per head in the denominator, attached to no value
            top = torch.maximum(logits.amax(-1, keepdim=True), sink)
            top = torch.where(top == float("-inf"), 0.0, top)  # a row with nothing visible: zero output and scores
            probs = logits.sub_(top).exp_()
            total = probs.sum(-1, keepdim=True) + torch.exp(sink - top)
            probs.div_(torch.where(total > 0, total, 1.0))
        chunk_out = torch.matmul(probs.view(batch, kv_heads, groups * size, cols).to(value.dtype), value[:, :, :cols])
        chunk_out = (
            chunk_out.view(batch, kv_heads, groups, size, value_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch, size, q_heads, value_dim)
        )
        if single:
            out = chunk_out.to(query.dtype)
        else:
            out[:, start:end] = chunk_out
        if end > score_from:
            first = max(start, score_from) - start
            part = probs[:, :, :, first:]
            if normalize_over is not None:  # a softmax restricted to those columns
                inside = normalize_over[:, None, None, None, :cols]
                part = part / (part * inside).sum(-1, keepdim=True).clamp_min(torch.finfo(part.dtype).tiny)
            if weight is not None:
                part = part * weight[:, None, None, start + first : end, None]
            column_scores = (part.sum(3) if reduce == "sum" else part.amax(3)).view(batch, q_heads, cols)
            if single:  # (cols == kv: the last chunk sees every column)
                scores = column_scores
            elif reduce == "sum":
                scores[..., :cols] += column_scores
            else:
                scores[..., :cols] = torch.maximum(scores[..., :cols], column_scores)
    if scores is None:  # (one chunk, all of it before `score_from`)
        scores = torch.zeros(batch, q_heads, kv, dtype=torch.float32, device=device)
    return out, scores
