"""SnapKV: keep what an observation window of the last queries attends to, smoothed by pooling.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469): the last `window`
queries of the prompt (the observation window) vote for the earlier tokens with their attention; votes are pooled
along the sequence so that the neighbours of a selected token come with it, and the window itself is kept.
Protocol (kvpress SnapKVPress, window 64, kernel 5): per query head, mean over the window queries of their softmax
attention to the tokens before the window; 1-D average pooling (kernel `kernel`, stride 1, zero padding kernel // 2)
along the token order; mean over the query heads of each KV group (GQA); the window tokens always kept (`recent` =
`window`).

Here: a multi-token forward is scored by its last `window` queries (the bridge computes only theirs:
`attention_window`; left padding weighted out); the stored tokens and the new ones are pooled in stream order
(pooling is along the sequence, whatever slots they sit in). In decode, the observation window is the last `window`
decode queries (a ring of their attention rows per slot; the prompt's window counts as one row until `window` steps
have passed), pooled the same way before each eviction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scored import ScoredPolicy, group_mean


def pool_in_order(scores: torch.Tensor, stream: torch.Tensor, valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool scores [B, H, n] along the stream order of their tokens (`stream` [B, H, n]); invalid entries
    count as 0 and sit after the valid ones."""
    order = torch.where(valid, stream, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
    ordered = torch.where(valid, scores, 0.0).gather(-1, order)
    batch, heads, n = ordered.shape
    pooled = F.avg_pool1d(ordered.reshape(batch * heads, 1, n), kernel, stride=1, padding=kernel // 2)
    return torch.empty_like(ordered).scatter_(-1, order, pooled.reshape(batch, heads, n))


def pool_before_window(scores, stream, valid, newest: int, window: int, kernel: int) -> torch.Tensor:
    """Pool the tokens before the observation window (stream index <= newest - window) only, as kvpress does; the
    window's own tokens (kept by a recent window) and invalid slots score 0."""
    before_window = valid & (stream <= newest - window)
    return torch.where(before_window, pool_in_order(scores, stream, before_window, kernel), 0.0)


def chunk_votes(
    view, column_scores: torch.Tensor, heads: int, stored_stream: torch.Tensor, window: int, kernel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pending chunk's window votes [B, heads, used + q] (column scores over the real queries of the observation
    window: its mean attention) for the stored tokens then the chunk's, and the same votes pooled."""
    real, seen_before = view.pending.real, view.pending.seen_before
    count = real[:, -window:].sum(-1).clamp_min(1).float()[:, None, None]  # real queries in the window
    scores = group_mean(column_scores.float(), heads) / count
    used, q = view.used, real.shape[1]
    new_stream = (seen_before + torch.arange(q, device=scores.device)).expand(scores.shape[0], heads, q)
    stream = torch.cat((stored_stream[..., :used], new_stream), -1)
    valid = torch.cat((view.valid[..., :used], real[:, None, :].expand(-1, heads, -1)), -1)
    return scores, pool_before_window(scores, stream, valid, seen_before + q - 1, window, kernel)


def record_decode_row(rows: torch.Tensor, row: torch.Tensor, step: int, window: int) -> None:
    """A decode query's attention `row` [B, H, n] (n <= slots; the other slots get 0) into ring row `step % window`
    of `rows` [B, H, window, slots] (by index: the same ops at every step); `step` counts decode steps since the
    last chunk (not stream indices, which padding shifts)."""
    index = torch.full((1,), step % window, dtype=torch.long, device=row.device)
    full = row.new_zeros(rows.shape[:2] + rows.shape[3:])
    full[..., : row.shape[-1]] = row
    rows.index_copy_(2, index, full[:, :, None])


class SnapKVPolicy(ScoredPolicy):
    deferred = True
    needs_attention = True

    def __init__(
        self,
        budget,
        window: int = 64,
        kernel: int = 5,
        sinks: int = 0,
        recent: int = 0,
        recent_share: float = 0.0,
        rescore_every: int = 1,
    ):
        super().__init__(
            budget, recent=max(window, recent), sinks=sinks, recent_share=recent_share, rescore_every=rescore_every
        )
        self.window, self.kernel = window, kernel
        self.attention_window = window
        self.rows: torch.Tensor | None = None  # [B, Hkv, window, slots + 1] attention of the last decode queries
        self._seed: torch.Tensor | None = None  # a chunk's window votes, put in the ring after the chunk is placed
        # stream index at the end of the last chunk: decode step k writes ring row k % window (row 0, the chunk's
        # votes, lasts `window` steps), the same in every row of a padded batch as alone
        self.ring_origin = 0

    def observe(self, view, column_scores: torch.Tensor) -> None:
        heads = self.scores.shape[1]
        if view.pending is None:  # decode: one query, the columns are the slots
            record_decode_row(
                self.rows, group_mean(column_scores.float(), heads), view.seen - self.ring_origin, self.window
            )
            return
        pending = view.pending
        real, positions, seen_before = pending.real, pending.positions, pending.seen_before
        used = view.used
        scores, pooled = chunk_votes(view, column_scores, heads, self.stream, self.window, self.kernel)
        self._seed = scores  # the prompt's window as one ring row, re-slotted after the commit
        self.ring_origin = seen_before + real.shape[1]
        view.commit(self.select_chunk(view, real, seen_before, positions, pooled[..., :used], pooled[..., used:]))

    def after_write(self, view, placement, keys, dest, positions, seen_before: int) -> None:
        new_scores = self._new_scores
        super().after_write(view, placement, keys, dest, positions, seen_before)
        if self.rows is None:
            self.rows = self.scores.new_zeros(self.scores.shape[:2] + (self.window, self.scores.shape[-1]))
        # a slot's new token starts with no votes from earlier queries
        self.rows.scatter_(3, dest[:, :, None, :].expand(-1, -1, self.window, -1), 0.0)
        seed = self._seed
        if new_scores is not None and seed is not None:  # after a chunk: its window's votes in ring row 0
            used_before = seed.shape[-1] - placement.src.shape[-1]
            row = torch.zeros_like(self.scores)
            row[..., :used_before] = seed[..., :used_before] * view.valid[..., :used_before]
            row.scatter_(2, dest, seed[..., used_before:].gather(2, placement.src.expand(dest.shape)))
            self.rows.zero_()
            self.rows[:, :, 0] = row
            self._seed = None

    def refresh(self, view, real: torch.Tensor) -> None:
        c = self.capacity
        scores = self.rows[..., :c].sum(2) / self.window
        valid, stream = view.valid[..., :c], self.stream[..., :c]
        pooled = pool_before_window(scores, stream, valid, view.seen, self.window, self.kernel)
        self.scores[..., :c] = self.protect(pooled, view.positions[..., :c])

    def map_batch(self, fn) -> None:
        super().map_batch(fn)
        if self.rows is not None:
            self.rows = fn(self.rows)

    def reset(self) -> None:
        super().reset()
        self.rows, self.ring_origin = None, 0

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.rows is None else self.rows.nbytes)
