"""SnapKV (Li et al., arXiv 2404.14469): keep what an observation window of the last queries attends to, pooled.

The last `window` queries of the prompt (the observation window) vote for the earlier tokens with their attention;
votes are pooled along the sequence so that the neighbours of a selected token come with it, and the window itself
is kept (its host keeps at least `window` recent tokens). Protocol (kvpress SnapKVPress, window 64, kernel 5): per
query head, mean over the window queries of their softmax attention to the tokens before the window; 1-D average
pooling (kernel `kernel`, stride 1, zero padding kernel // 2) along the token order; mean over the query heads of
each KV group (GQA).

A multi-token forward is scored by its last `window` queries (the bridge computes only theirs: `attention_window`;
left padding weighted out); the stored tokens and the new ones are pooled in stream order (pooling is along the
sequence, whatever slots they sit in). In decode, the observation window is the last `window` decode queries (a ring
of their attention rows per slot, `rows`, moved with the tokens; the prompt's window counts as one row until
`window` steps have passed), pooled the same way before each selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..common.compile_static import StaticField
from ..common.validation import require_int
from .base import Prompt, Scorer, group_mean, slot_state, state

WINDOW, KERNEL = 64, 5  # kvpress's defaults (SnapKVPress)


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


def window_votes(keys: torch.Tensor, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """keys [Hkv, P, D], the prompt's last w queries [Hq, w, D] -> [Hkv, P]: the window's mean softmax attention
    (causal within the window), mean over each KV group's query heads: what the bridge's column scores give `observe`
    for a whole prompt."""
    heads, prompt = keys.shape[0], keys.shape[1]
    q_heads, w = queries.shape[0], queries.shape[1]
    expanded = keys.float().repeat_interleave(q_heads // heads, dim=0)  # [Hq, P, D]
    logits = queries.float() @ expanded.transpose(1, 2) * scaling  # [Hq, w, P]
    position = torch.arange(prompt, device=keys.device)
    query_position = prompt - w + torch.arange(w, device=keys.device)
    logits = logits.masked_fill(position[None, None, :] > query_position[None, :, None], float("-inf"))
    return group_mean(logits.softmax(-1).mean(1)[None], heads)[0]


def record_decode_row(rows: torch.Tensor, row: torch.Tensor, step: int, window: int) -> None:
    """A decode query's attention `row` [B, H, n] (n <= slots; the other slots get 0) into ring row `step % window`
    of `rows` [B, H, window, slots] (by index: the same ops at every step); `step` counts decode steps since the
    last chunk (not stream indices, which padding shifts)."""
    index = torch.full((1,), step % window, dtype=torch.long, device=row.device)
    full = row.new_zeros(rows.shape[:2] + rows.shape[3:])
    full[..., : row.shape[-1]] = row
    rows.index_copy_(2, index, full[:, :, None])


@dataclass(eq=False)
class SnapKV(Scorer):
    window: int = StaticField(WINDOW)  # torch.compile specialises on it (hf_kvcache.common.compile_static)
    kernel: int = StaticField(KERNEL)

    name: ClassVar[str] = "snapkv"
    reads: ClassVar[str] = "attention of the last `window` queries"
    small: ClassVar[dict] = {"window": 2}
    needs_attention: ClassVar[bool] = True
    rescores: ClassVar[bool] = True
    prompt_reads: ClassVar[tuple[str, ...]] = ("keys", "queries")

    rows: torch.Tensor | None = slot_state()  # [B, Hm, window, slots + 1] attention rows of the last decode queries
    _seed: torch.Tensor | None = state()  # a chunk's window votes of its new tokens, until they are written
    # stream index at the end of the last chunk: decode step k writes ring row k % window (row 0, the chunk's votes,
    # lasts `window` steps), the same in every row of a padded batch as alone
    ring_origin: int = state(0)

    def __post_init__(self):
        require_int("window", self.window, 1)
        require_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"`kernel` must be odd (pooling keeps the sequence length), got {self.kernel}.")
        self.attention_window = self.window

    def score(self, prompt: Prompt) -> torch.Tensor:
        heads, length = prompt.keys.shape[0], prompt.keys.shape[1]
        votes = window_votes(prompt.keys, prompt.queries, prompt.scaling)[None]
        stream = torch.arange(length, device=votes.device).expand(1, heads, length)
        valid = torch.ones_like(stream, dtype=torch.bool)
        return pool_before_window(votes, stream, valid, length - 1, prompt.queries.shape[1], self.kernel)[0]

    def observe(self, host, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        heads = view.valid.shape[1]
        if self.rows is None:
            self.rows = self.slot_tensor(host, self.window)
        if view.pending is None:  # decode: one query, the columns are the slots; a row of the ring
            step = view.seen - self.ring_origin
            record_decode_row(self.rows, group_mean(column_scores.float(), heads), step, self.window)
            return None
        used = view.used
        chunk = view.pending
        self.ring_origin = chunk.seen_before + chunk.real.shape[1]
        scores, pooled = chunk_votes(view, column_scores, heads, host.stream, self.window, self.kernel)
        host.scores[..., :used] = pooled[..., :used]
        # the window's votes become ring row 0: the stored tokens' now (the chunk's moves carry them), the new
        # tokens' when they are written
        self.rows.zero_()
        self.rows[:, :, 0, :used] = scores[..., :used] * view.valid[..., :used]
        self._seed = scores[..., used:]
        return pooled

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        if self.rows is None:
            self.rows = self.slot_tensor(host, self.window)
        self.rows.scatter_(3, dest[:, :, None].expand(-1, -1, self.window, -1), 0.0)  # no votes from earlier queries
        if self._seed is not None:
            row = self.rows[:, :, 0]
            row.scatter_(2, dest, self._seed.gather(2, placement.src.expand(dest.shape)))
            self._seed = None
        return None

    def before_selection(self, host, view, real: torch.Tensor) -> None:
        c = host.capacity
        scores = self.rows[..., :c].sum(2) / self.window
        host.scores[..., :c] = pool_before_window(
            scores, host.stream[..., :c], view.valid[..., :c], view.seen, self.window, self.kernel
        )
