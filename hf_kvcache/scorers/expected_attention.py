"""Expected attention (Devoto et al., arXiv 2510.00636; kvpress ExpectedAttentionPress): keep the tokens that future
queries are expected to attend to, from query statistics.

Queries are modelled as Gaussian: mean mu and covariance Sigma per query head, from the prompt's queries before RoPE,
the first `sinks` positions excluded (outliers). Future queries sit at the next `future` positions, so their
statistics are rotated by the average RoPE rotation R over those positions: mu' = R mu, Sigma' = R Sigma R^T. For a
key k the expected logit is  s mu'.k + s^2/2 k^T Sigma' k  (s = 1/sqrt(d), the moment generating function of a
Gaussian); scores are the softmax of those logits over the candidate keys, averaged over the query heads of each KV
group (GQA), times ||v||. Protocol defaults are kvpress's: future 512, sinks 4, covariance and value norm on,
epsilon 0.

The statistics come from the actual queries the model computes (from the bridge, `needs_queries`: RoPE-rotated, so
they are un-rotated with the model's RoPE at their position ids; biases and QK norms are therefore included, which
kvpress's projection of hidden states leaves out), padding weighted out, accumulated over every multi-token forward
(chunked prefill sees the statistics of all chunks so far; stored tokens are re-scored at each chunk). Decode keeps
the last statistics: each token's expected logits (per query head) and value norm are computed once when it arrives
and kept per slot (moved with the token); each selection takes the group-mean softmax over the stored tokens, the
sinks (position ids below `sinks`, and the host's sink slots: the composite's sinks region) left out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.rope import KeyRotator
from ..common.validation import require_int
from .base import Scorer, bound, group_mean, slot_state, state


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


@dataclass(eq=False)
class ExpectedAttention(Scorer):
    sinks: int = 4
    future: int = 512
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0
    rotator: KeyRotator | None = bound()  # the model's RoPE (None: a model without RoPE); set by the cache

    name: ClassVar[str] = "expected_attention"
    reads: ClassVar[str] = "queries (statistics), keys, values"
    small: ClassVar[dict] = {"future": 16}
    needs_queries: ClassVar[bool] = True
    reads_stored_keys: ClassVar[bool] = True
    rescores: ClassVar[bool] = True

    count: torch.Tensor | None = state()  # running query statistics [B, 1, 1], [B, Hq, D], [B, Hq, D, D]
    total: torch.Tensor | None = state()
    outer: torch.Tensor | None = state()
    mean: torch.Tensor | None = state()  # rotated to the future positions
    cov: torch.Tensor | None = state()
    logits: torch.Tensor | None = slot_state()  # [B, Hm, groups, slots + 1] expected logits per query head
    value_norm: torch.Tensor | None = slot_state()  # [B, Hm, 1, slots + 1]
    _chunk: tuple | None = state()  # a chunk's new tokens' (logits, value norms), until they are written

    def __post_init__(self):
        require_int("sinks", self.sinks, 0)
        require_int("future", self.future, 1)
        for name in ("use_covariance", "use_value_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")

    def _valid(self, host, view, n: int) -> torch.Tensor:
        """Candidates of the softmax among the first n slots: valid, outside the host's sink slots and the sinks'
        positions."""
        outside = torch.arange(n, device=view.valid.device) >= host.sink_slots
        return view.valid[..., :n] & outside & (view.positions[..., :n] >= self.sinks)

    def observe_queries(self, host, view, query: torch.Tensor) -> torch.Tensor | None:
        if view.pending is None:  # decode: the statistics stay those of the prompt
            return None
        pending = view.pending
        keys, values, real, positions = pending.keys, pending.values, pending.real, pending.positions
        running = None if self.count is None else (self.count, self.total, self.outer)
        self.count, self.total, self.outer = accumulate_queries(
            running, query, real, positions, self.sinks, self.rotator, view.layer_idx, self.use_covariance
        )
        start = positions.max(-1).values + 1
        self.mean, self.cov = future_statistics(
            self.count, self.total, self.outer, self.rotator, view.layer_idx, start, self.future
        )
        used = view.used
        if used:
            stored_k, stored_v = view.read(used)
            keys = torch.cat((stored_k, keys.to(stored_k.dtype)), 2)
            values = torch.cat((stored_v, values.to(stored_v.dtype)), 2)
        batch, heads, n = keys.shape[:3]
        logits = expected_logits(keys, self.mean, self.cov)  # [B, Hq, n]
        value_norm = values.float().norm(dim=-1) if self.use_value_norm else None
        new_valid = real[:, None].expand(-1, heads, -1) & (positions[:, None] >= self.sinks)
        valid = torch.cat((self._valid(host, view, used).expand(-1, heads, -1), new_valid), -1)
        scores = expected_attention_scores(logits, valid, value_norm, heads, self.epsilon)
        if self.logits is None:
            self.logits = self.slot_tensor(host, logits.shape[1] // heads)
            self.value_norm = self.slot_tensor(host, 1, 1.0)
        logits = logits.view(batch, heads, -1, n)
        self.logits[..., :used] = logits[..., :used]
        if value_norm is not None:
            self.value_norm[..., 0, :used] = value_norm[..., :used]
        self._chunk = (logits[..., used:], None if value_norm is None else value_norm[..., used:])
        host.scores[..., :used] = scores[..., :used]
        return scores

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        src = placement.src.expand(dest.shape)
        groups = self.logits.shape[2]
        if self._chunk is not None:
            logits, value_norm = self._chunk
            logits = logits.gather(3, src[:, :, None].expand(-1, -1, groups, -1))
            self._chunk = None
        else:  # decode: the new token, with the statistics of the prompt
            logits = expected_logits(keys, self.mean, self.cov).view(dest.shape[0], dest.shape[1], groups, -1)
            value_norm = view.incoming.values.float().norm(dim=-1) if self.use_value_norm else None
        self.logits.scatter_(3, dest[:, :, None].expand(-1, -1, groups, -1), logits)
        if value_norm is not None:
            self.value_norm[:, :, 0].scatter_(2, dest, value_norm.gather(2, src))
        return None

    def before_selection(self, host, view, real: torch.Tensor) -> None:
        c = host.capacity
        heads = view.valid.shape[1]
        logits = self.logits[..., :c].flatten(1, 2)  # [B, Hq, c] (query head h * groups + g)
        value_norm = self.value_norm[:, :, 0, :c] if self.use_value_norm else None
        host.scores[..., :c] = expected_attention_scores(
            logits, self._valid(host, view, c), value_norm, heads, self.epsilon
        )
