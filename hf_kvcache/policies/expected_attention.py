"""Expected attention: keep the tokens that future queries are expected to attend to, from query statistics.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution"
(arXiv 2510.00636; kvpress ExpectedAttentionPress). Queries are modelled as Gaussian: mean mu and covariance Sigma
per query head, from the prompt's queries before RoPE, the first `sinks` excluded (outliers). Future queries sit at
the next `future` positions, so their statistics are rotated by the average RoPE rotation R over those positions:
mu' = R mu, Sigma' = R Sigma R^T. For a key k the expected logit is  s mu'.k + s^2/2 k^T Sigma' k  (s = 1/sqrt(d),
the moment generating function of a Gaussian); scores are the softmax of those logits over the candidate keys,
averaged over the query heads of each KV group (GQA), times ||v||. The first `sinks` tokens are always kept.
Protocol defaults are kvpress's: future 512, sinks 4, covariance and value norm on, epsilon 0.

Here the statistics come from the actual queries the model computes (taken from the bridge, `needs_queries`:
RoPE-rotated, so they are un-rotated with the model's RoPE at their position ids; biases and QK norms are therefore
included, which kvpress's projection of hidden states leaves out), padding weighted out, accumulated over every
multi-token forward (chunked prefill sees the statistics of all chunks so far; stored tokens are re-scored at each
chunk). Decode keeps the last statistics: each token's logits are computed once when it arrives, and each eviction
takes the group-mean softmax over the stored tokens, times their value norms. No attention probabilities are computed.
"""

from __future__ import annotations

import math

import torch

from ..common.rope import KeyRotator
from .base import Placement
from .scored import ScoredPolicy, group_mean


def future_rotation(rotator: KeyRotator | None, layer_idx: int, start: torch.Tensor, future: int, dim: int):
    """M [B, D, D] with M = R^T, R the mean RoPE rotation over positions start .. start + future - 1 (start [B]),
    so that row vectors transform as x @ M = (R x)^T. Identity on a layer without RoPE."""
    batch = start.shape[0]
    eye = torch.eye(dim, device=start.device)
    if rotator is None or not rotator.applies(layer_idx):
        return eye.expand(batch, dim, dim)
    rows = eye.repeat(future, 1)[None, None].expand(batch, 1, future * dim, dim)  # [B, 1, future * D, D]
    delta = (start[:, None] + torch.arange(future, device=start.device).repeat_interleave(dim)[None]).long()
    rotated = rotator.rotate(rows, delta, layer_idx)
    return rotated.view(batch, future, dim, dim).mean(1)


def expected_logits(keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None) -> torch.Tensor:
    """keys [B, Hkv, n, D], mean [B, Hq, D], cov [B, Hq, D, D] or None -> expected logits [B, Hq, n] (float32)."""
    _batch, kv_heads, _n, dim = keys.shape
    groups = mean.shape[1] // kv_heads
    k = keys.float().repeat_interleave(groups, dim=1)  # [B, Hq, n, D]
    scale = 1.0 / math.sqrt(dim)
    logits = (k @ mean[..., None])[..., 0] * scale
    if cov is not None:
        logits = logits + ((k @ cov) * k).sum(-1) * (scale * scale / 2)
    return logits


def expected_attention_scores(
    logits: torch.Tensor, valid: torch.Tensor, value_norm: torch.Tensor | None, kv_heads: int, epsilon: float = 0.0
) -> torch.Tensor:
    """Softmax of expected logits [B, Hq, n] over the valid candidates (valid [B, Hkv or 1, n]), group mean, times
    the value norms [B, Hkv, n] -> [B, Hkv, n]."""
    groups = logits.shape[1] // kv_heads
    mask = valid.expand(-1, kv_heads, -1).repeat_interleave(groups, dim=1)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    scores = group_mean(probs, kv_heads)
    if value_norm is not None:
        scores = (scores + epsilon) * value_norm
    return scores


def accumulate_queries(
    running: tuple | None,
    query: torch.Tensor,
    real,
    positions,
    sinks: int,
    rotator: KeyRotator | None,
    layer_idx: int,
    use_covariance: bool,
) -> tuple:
    """(count [B, 1, 1], sum [B, Hq, D], sum of outer products [B, Hq, D, D] or None) of the queries so far:
    `running` (None at first) plus this forward's queries [B, Hq, q, D], un-rotated with the model's RoPE at their
    position ids, padding and position ids below `sinks` left out."""
    q = query.float()
    if rotator is not None:
        q = rotator.rotate(q, -positions.to(q.device), layer_idx)
    weight = (real & (positions >= sinks)).float()[:, None, :, None]  # [B, 1, q, 1]
    count, total = weight.sum(2), (q * weight).sum(2)
    outer = (q * weight).transpose(-1, -2) @ q if use_covariance else None
    if running is None:
        return count, total, outer
    return running[0] + count, running[1] + total, None if outer is None else running[2] + outer


def future_statistics(
    count, total, outer, rotator: KeyRotator | None, layer_idx: int, start: torch.Tensor, future: int
) -> tuple:
    """(mean [B, Hq, D], covariance [B, Hq, D, D] or None) of the accumulated queries, rotated to the mean RoPE
    rotation of positions start .. start + future - 1 (start [B])."""
    n = count.clamp_min(1.0)  # [B, 1, 1]
    mean = total / n
    m = future_rotation(rotator, layer_idx, start, future, total.shape[-1])[:, None]
    rotated_mean = (mean[:, :, None] @ m)[:, :, 0]
    if outer is None:
        return rotated_mean, None
    cov = outer / n[..., None] - mean[..., :, None] * mean[..., None, :]
    return rotated_mean, m.transpose(-1, -2) @ cov @ m


class ExpectedAttentionPolicy(ScoredPolicy):
    deferred = True
    needs_queries = True

    def __init__(
        self,
        budget,
        recent: int = 0,
        sinks: int = 4,
        future: int = 512,
        use_covariance: bool = True,
        use_value_norm: bool = True,
        epsilon: float = 0.0,
        rotator: KeyRotator | None = None,
        recent_share: float = 0.0,
        rescore_every: int = 1,
    ):
        super().__init__(budget, recent=recent, sinks=sinks, recent_share=recent_share, rescore_every=rescore_every)
        self.future, self.use_covariance, self.use_value_norm = future, use_covariance, use_value_norm
        self.epsilon, self.query_rotator = epsilon, rotator
        self.count = self.total = self.outer = None  # running query statistics [B, 1, 1], [B, Hq, D], [B, Hq, D, D]
        self.mean = self.cov = None  # rotated to the future positions
        self.logits: torch.Tensor | None = None  # [B, Hq, slots + 1] expected logits of each slot's token
        self.value_norm: torch.Tensor | None = None  # [B, Hkv, slots + 1]

    def _statistics(self, view, query: torch.Tensor, real, positions) -> None:
        """Accumulate the forward's queries (un-rotated, sinks and padding out); rotate the statistics forward."""
        running = None if self.count is None else (self.count, self.total, self.outer)
        self.count, self.total, self.outer = accumulate_queries(
            running, query, real, positions, self.sinks, self.query_rotator, view.layer_idx, self.use_covariance
        )
        self.mean, self.cov = future_statistics(
            self.count,
            self.total,
            self.outer,
            self.query_rotator,
            view.layer_idx,
            positions.max(-1).values + 1,
            self.future,
        )

    def observe_queries(self, view, query: torch.Tensor) -> None:
        if view.pending is None:  # decode: statistics stay those of the prompt
            return
        pending = view.pending
        keys, values, real, positions = pending.keys, pending.values, pending.real, pending.positions
        seen_before = pending.seen_before
        self._statistics(view, query, real, positions)
        used = view.used
        if used:
            stored_k, stored_v = view.read(used)
            keys = torch.cat((stored_k, keys.to(stored_k.dtype)), 2)
            values = torch.cat((stored_v, values.to(stored_v.dtype)), 2)
        heads = keys.shape[1]
        logits = expected_logits(keys, self.mean, self.cov)
        value_norm = values.float().norm(dim=-1) if self.use_value_norm else None
        candidate_positions = torch.cat(
            (view.positions[..., :used].long().expand(-1, heads, -1), positions[:, None].expand(-1, heads, -1)), -1
        )
        valid = torch.cat((view.valid[..., :used], real[:, None].expand(-1, heads, -1)), -1)
        scores = expected_attention_scores(
            logits, valid & (candidate_positions >= self.sinks), value_norm, heads, self.epsilon
        )
        self._ensure_buffers()
        self.logits[..., :used] = logits[..., :used]
        if value_norm is not None:
            self.value_norm[..., :used] = value_norm[..., :used]
        self._chunk_logits = (logits[..., used:], None if value_norm is None else value_norm[..., used:])
        view.commit(self.select_chunk(view, real, seen_before, positions, scores[..., :used], scores[..., used:]))

    def _ensure_buffers(self) -> None:
        if self.logits is None:
            batch, _, slots = self.scores.shape
            self.logits = self.scores.new_zeros(batch, self.mean.shape[1], slots)
            self.value_norm = self.scores.new_ones(self.scores.shape)

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        chunk = getattr(self, "_chunk_logits", None)
        if chunk is not None:
            logits, value_norm = chunk
            self._chunk_logits = None
        else:  # decode: the new token, with the statistics of the prompt
            values = view.incoming.values
            src = placement.src.expand(dest.shape)
            logits = expected_logits(keys, self.mean, self.cov)
            value_norm = values.float().norm(dim=-1).gather(2, src) if self.use_value_norm else None
            src = None
        if chunk is not None:
            src = placement.src.expand(dest.shape)
            logits = logits.gather(2, src.repeat_interleave(logits.shape[1] // dest.shape[1], dim=1))
            value_norm = None if value_norm is None else value_norm.gather(2, src)
        groups = self.logits.shape[1] // dest.shape[1]
        self.logits.scatter_(2, dest.repeat_interleave(groups, dim=1), logits)
        if value_norm is not None:
            self.value_norm.scatter_(2, dest, value_norm)
        super().after_write(view, placement, keys, dest, positions, seen_before)

    def refresh(self, view, real: torch.Tensor) -> None:
        c = self.capacity
        heads = self.scores.shape[1]
        valid = view.valid[..., :c] & (view.positions[..., :c] >= self.sinks)
        value_norm = self.value_norm[..., :c] if self.use_value_norm else None
        scores = expected_attention_scores(self.logits[..., :c], valid, value_norm, heads, self.epsilon)
        self.scores[..., :c] = self.protect(scores, view.positions[..., :c])

    def map_batch(self, fn) -> None:
        super().map_batch(fn)
        for name in ("count", "total", "outer", "mean", "cov", "logits", "value_norm"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def reset(self) -> None:
        super().reset()
        self.count = self.total = self.outer = self.mean = self.cov = self.logits = self.value_norm = None

    def nbytes(self) -> int:
        extra = (self.count, self.total, self.outer, self.mean, self.cov, self.logits, self.value_norm)
        return super().nbytes() + sum(t.nbytes for t in extra if t is not None)
