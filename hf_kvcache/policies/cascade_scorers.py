"""What ranks the heavy hitters of CompositeCache's `heavy` region: one scorer object per layer's CascadePolicy.

The scores are the per-slot tensor `policy.scores` [B, Hm, slots + 1] of the CascadePolicy (higher = kept); the
policy places tokens, moves them between regions (carrying their scores) and picks the heavy hitters by those scores.
A scorer only says what the scores are, through these hooks:
- `chunk_scores(policy, view, real)`: a multi-token forward of a scorer that needs neither attention nor queries
  (placed at once): the new tokens' scores [B, Hm, q]; it may re-score the stored ones (policy.scores[..., :used]).
- `observe(policy, view, column_scores)` / `observe_queries(policy, view, query)`: from the bridge, for scorers
  that need attention (`needs_attention`) or the forward's queries (`needs_queries`). In decode (no pending chunk)
  they update the stored scores and return None; for a pending chunk they update the stored tokens' scores and
  return the scores [B, Hm, used + q] of the stored and the new tokens (the policy then places the chunk).
- `before_selection(policy, view, real)`: a decode step in which a heavy selection is due; scorers whose scores
  are relative to the current candidates re-score the stored tokens here.
- `arrival(policy, view, placement, keys, dest)`: after the new tokens were written to slots `dest`: their scores
  (None: 0, set later by `observe`), and any per-slot state of the scorer for them.
- `move(src, dest)`: the policy moved tokens from slots src to dest (dest may be the trash slot): per-slot state
  of the scorer follows them. `map_batch`, `reset`, `nbytes`: as for policies.

The scorers, each the scorer function of its standalone policy, so that a composite of one recent window and heavy
hitters keeps the tokens the standalone cache keeps:
- "h2o" (heavy_hitter.py): attention received, accumulated (aggregated over each KV group's query heads);
- "tova" (tova.py): the last query's attention, layer-wide mean, replaced at every forward (`attention_window` 1);
- "knorm" (knorm.py): minus the key norm, fixed at arrival; no attention is computed;
- "keydiff" (keydiff.py): key diversity, re-scored over the stored keys and the new ones before each selection; no
  attention is computed;
- "snapkv" (snapkv.py): the attention of an observation window of the last `window` queries (default 64, at most
  the composite's window regions' span, which keep those tokens), pooled along the stream with `kernel` (5); a
  chunk's last `window` queries score it, in decode a ring of the last `window` decode queries' attention rows
  (each slot's column, moved with its token) is pooled again before each selection;
- "expected_attention" (expected_attention.py): expected attention of future queries from the prompt's query
  statistics (RoPE-rotated to the next 512 positions, covariance and value norms on, kvpress's protocol); the
  composite's `sinks` region plays the scorer's sinks (left out of the statistics and of the softmax: give a sinks
  region of 4 tokens for kvpress's protocol). Each token's expected logits (per query head) and value norm are kept
  per slot, moved with the token; each selection takes the softmax over the stored tokens. No attention
  probabilities are computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.compile_static import StaticInt, fixed_shape
from ..common.rope import KeyRotator
from .expected_attention import accumulate_queries, expected_attention_scores, expected_logits, future_statistics
from .heavy_hitter import HeavyHitterPolicy
from .keydiff import keydiff_scores
from .knorm import knorm_scores
from .scored import group_mean
from .snapkv import chunk_votes, pool_before_window, record_decode_row
from .tova import tova_scores


class HeavyScorer:
    """No scores: the composite without a heavy region (its tokens are evicted or all kept)."""

    needs_attention = False
    needs_queries = False
    reads_stored_keys = False  # True when it reads the stored (dequantized) keys itself, whatever attention reads
    attention_window: int | None = (
        StaticInt()
    )  # sizes: torch.compile specialises on them (hf_kvcache.common.compile_static)

    @property
    def deferred(self) -> bool:  # chunks are placed after the bridge hands over what the scores need
        return self.needs_attention or self.needs_queries

    def chunk_scores(self, policy, view, real: torch.Tensor) -> torch.Tensor | None:
        return None

    def observe(self, policy, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{type(self).__name__} does not use attention scores")

    def observe_queries(self, policy, view, query: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"{type(self).__name__} does not use queries")

    def before_selection(self, policy, view, real: torch.Tensor) -> None:
        pass

    def arrival(self, policy, view, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        return None

    def move(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        pass

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        pass

    def reset(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class _AttentionScorer(HeavyScorer):
    """Scores from the attention column scores the bridge hands over: `_scores` maps them to [B, Hm, n], `_update`
    folds them into the stored tokens' scores."""

    needs_attention = True

    def _scores(self, column_scores: torch.Tensor, heads: int) -> torch.Tensor:
        raise NotImplementedError

    def _update(self, stored: torch.Tensor, scores: torch.Tensor) -> None:
        raise NotImplementedError

    def observe(self, policy, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        scores = self._scores(column_scores, view.valid.shape[1])
        n = scores.shape[-1] if view.pending is None else view.used
        self._update(policy.scores[..., :n], scores[..., :n])
        return None if view.pending is None else scores


class H2OScorer(_AttentionScorer):
    def __init__(self, aggregation: str):
        self.aggregation = HeavyHitterPolicy(0, 0, aggregation)  # its `aggregate` over each KV group's query heads

    def _scores(self, column_scores: torch.Tensor, heads: int) -> torch.Tensor:
        return self.aggregation.aggregate(column_scores, heads)

    def _update(self, stored: torch.Tensor, scores: torch.Tensor) -> None:
        stored += scores  # accumulated


class TOVAScorer(_AttentionScorer):
    attention_window = 1  # the last query's attention only

    def _scores(self, column_scores: torch.Tensor, heads: int) -> torch.Tensor:
        return tova_scores(column_scores, heads)

    def _update(self, stored: torch.Tensor, scores: torch.Tensor) -> None:
        stored.copy_(scores)  # replaced by each forward's last query


class KnormScorer(HeavyScorer):
    def chunk_scores(self, policy, view, real: torch.Tensor) -> torch.Tensor:
        return knorm_scores(view.incoming.keys)

    def arrival(self, policy, view, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        return knorm_scores(keys)  # fixed at arrival


class KeyDiffScorer(HeavyScorer):
    reads_stored_keys = True

    def __init__(self):
        self._chunk_scores: torch.Tensor | None = None  # the new tokens' scores of a chunk, until they are written

    def _candidates(self, view, real: torch.Tensor, n_stored: int) -> torch.Tensor:
        """KeyDiff scores [B, Hm, n_stored + q] of the first `n_stored` slots and the incoming tokens, the anchor
        taken over the valid ones (as KeyDiffPolicy does)."""
        keys = view.incoming.keys
        stored = view.read(n_stored)[0] if n_stored else keys[:, :, :0]
        candidates = torch.cat((stored, keys.to(stored.dtype)), 2)
        valid = torch.cat((view.valid[..., :n_stored], real[:, None].expand(-1, keys.shape[1], -1)), -1)
        return keydiff_scores(candidates, valid)

    def chunk_scores(self, policy, view, real: torch.Tensor) -> torch.Tensor:
        used = view.used
        scores = self._candidates(view, real, used)
        policy.scores[..., :used] = scores[..., :used]
        self._chunk_scores = scores[..., used:]
        return self._chunk_scores

    def before_selection(self, policy, view, real: torch.Tensor) -> None:
        c = policy.capacity
        policy.scores[..., :c] = self._candidates(view, real, c)[..., :c]

    def arrival(self, policy, view, placement, keys: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        if self._chunk_scores is None:  # decode: scored by the next selection
            return None
        scores = self._chunk_scores.gather(2, placement.src.expand(dest.shape))
        self._chunk_scores = None
        return scores

    def reset(self) -> None:
        self._chunk_scores = None


class _SlotState(HeavyScorer):
    """A scorer with per-slot state: tensors [B, Hm, X, slots + 1] whose last dim follows the tokens' slots."""

    slot_state: tuple[str, ...] = ()

    def _slot_tensor(self, policy, width: int, fill: float = 0.0) -> torch.Tensor:
        batch, heads, slots = policy.scores.shape
        state = policy.scores.new_full((batch, heads, width, slots), fill)
        fixed_shape(state)
        return state

    def move(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        for name in self.slot_state:
            state = getattr(self, name)
            if state is None:
                continue
            index = src[:, :, None].expand(-1, -1, state.shape[2], -1)
            moved = state.gather(3, index)  # all read before any is written (moves can be permutations)
            state.scatter_(3, dest[:, :, None].expand(-1, -1, state.shape[2], -1), moved)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self._tensors():
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def reset(self) -> None:
        for name in self._tensors():
            setattr(self, name, None)

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._tensors() if getattr(self, name) is not None)

    def _tensors(self) -> tuple[str, ...]:
        return self.slot_state


class SnapKVScorer(_SlotState):
    needs_attention = True
    slot_state = ("rows",)
    window, kernel = StaticInt(), StaticInt()

    def __init__(self, window: int, kernel: int):
        self.window, self.kernel = window, kernel
        self.attention_window = window
        self.rows: torch.Tensor | None = None  # [B, Hm, window, slots + 1] attention rows of the last decode queries
        self._seed: torch.Tensor | None = None  # a chunk's window votes of its new tokens, until they are written
        # stream index at the end of the last chunk: decode step k writes ring row k % window (row 0, the chunk's
        # votes, lasts `window` steps), the same in every row of a padded batch as alone
        self.ring_origin = 0

    def observe(self, policy, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        heads = view.valid.shape[1]
        if self.rows is None:
            self.rows = self._slot_tensor(policy, self.window)
        if view.pending is None:  # decode: one query, the columns are the slots; a row of the ring
            record_decode_row(
                self.rows, group_mean(column_scores.float(), heads), view.seen - self.ring_origin, self.window
            )
            return None
        used = view.used
        chunk = view.pending
        self.ring_origin = chunk.seen_before + chunk.real.shape[1]
        scores, pooled = chunk_votes(view, column_scores, heads, policy.stream, self.window, self.kernel)
        policy.scores[..., :used] = pooled[..., :used]
        # the window's votes become ring row 0: the stored tokens' now (the chunk's moves carry them), the new
        # tokens' when they are written
        self.rows.zero_()
        self.rows[:, :, 0, :used] = scores[..., :used] * view.valid[..., :used]
        self._seed = scores[..., used:]
        return pooled

    def arrival(self, policy, view, placement, keys: torch.Tensor, dest: torch.Tensor) -> None:
        if self.rows is None:
            self.rows = self._slot_tensor(policy, self.window)
        self.rows.scatter_(3, dest[:, :, None].expand(-1, -1, self.window, -1), 0.0)  # no votes from earlier queries
        if self._seed is not None:
            row = self.rows[:, :, 0]
            row.scatter_(2, dest, self._seed.gather(2, placement.src.expand(dest.shape)))
            self._seed = None
        return None

    def before_selection(self, policy, view, real: torch.Tensor) -> None:
        c = policy.capacity
        scores = self.rows[..., :c].sum(2) / self.window
        policy.scores[..., :c] = pool_before_window(
            scores, policy.stream[..., :c], view.valid[..., :c], view.seen, self.window, self.kernel
        )

    def _tensors(self) -> tuple[str, ...]:
        return ("rows", "_seed")


class ExpectedAttentionScorer(_SlotState):
    needs_queries = True
    reads_stored_keys = True
    slot_state = ("logits", "value_norm")
    FUTURE, EPSILON = 512, 0.0  # kvpress's defaults (ExpectedAttentionPress), as ExpectedAttentionCache's
    sinks = StaticInt()

    def __init__(self, sinks: int, rotator: KeyRotator | None):
        self.sinks, self.rotator = sinks, rotator
        self.count = self.total = self.outer = None  # running query statistics
        self.mean = self.cov = None  # rotated to the future positions
        self.logits: torch.Tensor | None = None  # [B, Hm, groups, slots + 1] expected logits per query head
        self.value_norm: torch.Tensor | None = None  # [B, Hm, 1, slots + 1]
        self._chunk: tuple | None = None  # a chunk's new tokens' (logits, value norms), until they are written

    def _valid(self, policy, view, n: int) -> torch.Tensor:
        """Candidates of the softmax among the first n slots: valid, outside the sinks region and its positions."""
        outside = torch.arange(n, device=view.valid.device) >= policy.sinks
        return view.valid[..., :n] & outside & (view.positions[..., :n] >= self.sinks)

    def observe_queries(self, policy, view, query: torch.Tensor) -> torch.Tensor | None:
        if view.pending is None:  # decode: the statistics stay those of the prompt
            return None
        pending = view.pending
        keys, values, real, positions = pending.keys, pending.values, pending.real, pending.positions
        running = None if self.count is None else (self.count, self.total, self.outer)
        self.count, self.total, self.outer = accumulate_queries(
            running, query, real, positions, self.sinks, self.rotator, view.layer_idx, True
        )
        self.mean, self.cov = future_statistics(
            self.count, self.total, self.outer, self.rotator, view.layer_idx, positions.max(-1).values + 1, self.FUTURE
        )
        used = view.used
        if used:
            stored_k, stored_v = view.read(used)
            keys = torch.cat((stored_k, keys.to(stored_k.dtype)), 2)
            values = torch.cat((stored_v, values.to(stored_v.dtype)), 2)
        batch, heads, n = keys.shape[:3]
        logits = expected_logits(keys, self.mean, self.cov)  # [B, Hq, n]
        value_norm = values.float().norm(dim=-1)
        new_valid = real[:, None].expand(-1, heads, -1) & (positions[:, None] >= self.sinks)
        valid = torch.cat((self._valid(policy, view, used), new_valid), -1)
        scores = expected_attention_scores(logits, valid, value_norm, heads, self.EPSILON)
        if self.logits is None:
            self.logits = self._slot_tensor(policy, logits.shape[1] // heads)
            self.value_norm = self._slot_tensor(policy, 1, 1.0)
        logits = logits.view(batch, heads, -1, n)
        self.logits[..., :used] = logits[..., :used]
        self.value_norm[..., 0, :used] = value_norm[..., :used]
        self._chunk = (logits[..., used:], value_norm[..., used:])
        policy.scores[..., :used] = scores[..., :used]
        return scores

    def arrival(self, policy, view, placement, keys: torch.Tensor, dest: torch.Tensor) -> None:
        src = placement.src.expand(dest.shape)
        groups = self.logits.shape[2]
        if self._chunk is not None:
            logits, value_norm = self._chunk
            logits = logits.gather(3, src[:, :, None].expand(-1, -1, groups, -1))
            self._chunk = None
        else:  # decode: the new token, with the statistics of the prompt
            logits = expected_logits(keys, self.mean, self.cov).view(dest.shape[0], dest.shape[1], groups, -1)
            value_norm = view.incoming.values.float().norm(dim=-1)
        self.logits.scatter_(3, dest[:, :, None].expand(-1, -1, groups, -1), logits)
        self.value_norm[:, :, 0].scatter_(2, dest, value_norm.gather(2, src))
        return None

    def before_selection(self, policy, view, real: torch.Tensor) -> None:
        c = policy.capacity
        heads = view.valid.shape[1]
        logits = self.logits[..., :c].flatten(1, 2)  # [B, Hq, c] (query head h * groups + g)
        policy.scores[..., :c] = expected_attention_scores(
            logits, self._valid(policy, view, c), self.value_norm[:, :, 0, :c], heads, self.EPSILON
        )

    def _tensors(self) -> tuple[str, ...]:
        return ("count", "total", "outer", "mean", "cov", "logits", "value_norm", "_chunk")

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self._chunk is not None:  # (only between a chunk's scores and its write: not a place to reorder)
            self._chunk = tuple(fn(t) for t in self._chunk)
        for name in self._tensors()[:-1]:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._tensors()[:-1] if getattr(self, name) is not None)


HEAVY_SCORERS = ("h2o", "tova", "knorm", "keydiff", "snapkv", "expected_attention")  # what ranks the heavy hitters
SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5  # SnapKVCache's (kvpress's) defaults


def make_heavy_scorer(
    name: str | None,
    aggregation: str = "sum",
    window: int = SNAPKV_WINDOW,
    kernel: int = SNAPKV_KERNEL,
    sinks: int = 0,
    rotator: KeyRotator | None = None,
) -> HeavyScorer:
    """The scorer called `name` (one of HEAVY_SCORERS), or no scorer (None: no heavy region). `window`, `kernel`:
    SnapKV's observation window and pooling kernel; `sinks`, `rotator`: expected attention's sinks (the composite's
    sinks region) and the model's RoPE (None: a model without RoPE)."""
    if name is None:
        return HeavyScorer()
    if name == "h2o":
        return H2OScorer(aggregation)
    if name == "snapkv":
        return SnapKVScorer(window, kernel)
    if name == "expected_attention":
        return ExpectedAttentionScorer(sinks, rotator)
    return {"tova": TOVAScorer, "knorm": KnormScorer, "keydiff": KeyDiffScorer}[name]()
