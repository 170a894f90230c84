"""LagKV (Liang et al., arXiv 2504.04704; kvpress LagKVPress): score each token against the partition that follows
it, from the keys and values alone.

After `sinks` tokens the sequence is cut into partitions of `lag` tokens. A token of partition p is normalised per
channel by the min and max of partition p + 1 (its "lag" reference), and its score is the standard deviation of
that over the channels, for its key and its value, softmaxed within the partition and averaged (key + value) / 2;
each partition then ranks its tokens (rank / lag in [0, 1): kvpress's default, `cross_scoring` off). The sinks,
the last full partition and the partial tail have no reference: kvpress scores them 1, kept before any scored
token; here the sinks come first (oldest first), then the tail (newest first), so that no two tokens tie (exact
ties would leave the choice to `topk`'s order of slots, which differs between a padded row and the row alone). No
attention and no queries are read.

Here the partitions are cut along the stream order of the candidates (stored tokens and new ones, padding and empty
slots left out), so the scores of a multi-token forward are kvpress's on the whole prompt; a decode selection
re-scores the stored tokens the same way (reading them: O(budget x head_dim) per step, as KeyDiff). A flat channel
(max = min in the reference) divides by a floor of 1e-6 instead of 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..common.validation import require_int
from .base import CandidateScorer


def _partition_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """states [B, H, P, lag, D] (P partitions) -> [B, H, P - 1, lag]: each partition's tokens normalised by the
    next partition's per-channel range, std over channels, softmax within the partition."""
    states = states.float()
    reference, scored = states[:, :, 1:], states[:, :, :-1]
    low = reference.amin(dim=-2, keepdim=True)
    span = (reference.amax(dim=-2, keepdim=True) - low).clamp_min(1e-6)
    return ((scored - low) / span).std(dim=-1).softmax(dim=-1)


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, order_key: torch.Tensor, sinks: int, lag: int):
    """keys, values [B, H, n, D]; order_key [B, H, n] (stream index, the largest value for padding and empty slots)
    -> scores [B, H, n]: within-partition ranks / lag in [0, 1) for the scored tokens, in [1, 2) for the unscored
    tail (newest first) and in (2, 3] for the sinks (oldest first), 0 for invalid candidates. No two valid tokens of
    a row tie: equal ranks of different partitions go to the later partition (less than a rank step apart), so a
    row of a padded batch keeps what it keeps alone, whatever slots its tokens use."""
    batch, heads, n, dim = keys.shape
    valid = order_key < torch.iinfo(order_key.dtype).max
    order = order_key.argsort(dim=-1, stable=True)  # the valid candidates first, in stream order
    count = valid.sum(-1, keepdim=True)  # [B, H, 1]
    position = torch.arange(n, device=keys.device)  # in stream order
    tie_break = position / (2 * n)  # < 1/2: keeps every level below the next
    ordered_scores = torch.where(position < sinks, 3.0 - tie_break, 1.0 + tie_break).expand(batch, heads, n)
    partitions = max(0, (n - sinks) // lag)
    if partitions >= 2:
        span = slice(sinks, sinks + partitions * lag)
        index = order[..., span, None]
        part_k = keys.gather(2, index.expand(-1, -1, -1, dim)).view(batch, heads, partitions, lag, dim)
        part_v = values.gather(2, index.expand(-1, -1, -1, values.shape[-1])).view(batch, heads, partitions, lag, -1)
        score = (_partition_scores(part_k, lag) + _partition_scores(part_v, lag)) / 2
        rank = score.argsort(dim=-1).argsort(dim=-1).float() / lag  # [B, H, P - 1, lag]
        body = rank.flatten(2) + tie_break[sinks : sinks + rank.shape[2] * lag] / lag  # [B, H, (P - 1) * lag]
        # a partition is scored when the row's valid tokens fill the partition after it (else: tail)
        full = (count - sinks).clamp_min(0) // lag  # [B, H, 1] full partitions of each row
        in_scored = (position >= sinks) & (position < sinks + (full - 1).clamp_min(0) * lag)
        padded = ordered_scores.clone()
        padded[..., sinks : sinks + body.shape[-1]] = body
        ordered_scores = torch.where(in_scored, padded, ordered_scores)
    ordered_scores = torch.where(position < count, ordered_scores, 0.0)
    return torch.empty_like(ordered_scores).scatter_(-1, order, ordered_scores)


@dataclass(eq=False)
class LagKV(CandidateScorer):
    sinks: int = 4
    lag: int = 128

    name: ClassVar[str] = "lagkv"
    reads: ClassVar[str] = "keys and values (the stored ones again at each selection)"
    small: ClassVar[dict] = {"sinks": 2, "lag": 2}

    def __post_init__(self):
        require_int("sinks", self.sinks, 0)
        require_int("lag", self.lag, 1)

    def candidates(self, host, view, real: torch.Tensor, n_stored: int, seen: int) -> torch.Tensor:
        incoming = view.incoming
        if n_stored:
            stored_k, stored_v = view.read(n_stored)
        else:
            stored_k, stored_v = incoming.keys[:, :, :0], incoming.values[:, :, :0]
        keys = torch.cat((stored_k, incoming.keys.to(stored_k.dtype)), 2)
        values = torch.cat((stored_v, incoming.values.to(stored_v.dtype)), 2)
        batch, heads, q = keys.shape[0], keys.shape[1], real.shape[1]
        new_stream = (seen + torch.arange(q, device=keys.device)).expand(batch, heads, q)
        stream = torch.cat((host.stream[..., :n_stored].expand(-1, heads, -1), new_stream), -1)
        valid = torch.cat((view.valid[..., :n_stored].expand(-1, heads, -1), real[:, None].expand(-1, heads, -1)), -1)
        order_key = torch.where(valid & (stream >= 0), stream, torch.iinfo(torch.long).max)
        return lagkv_scores(keys, values, order_key, self.sinks, self.lag)
