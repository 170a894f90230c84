"""The policy interface: given the new tokens of a forward and a view of the layer's slots (`SlotView`), say where each
one goes (or that it is dropped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..common.compile_static import StaticInt
from ..common.declared_state import DeclaredState


class Needs(NamedTuple):
    """What a layer's policy (its scorer's, for the hosts of a scorer) needs the attention bridge to hand over in the
    current forward: the bridge asks the layer (`CompressedLayer.needs`) instead of reading policy attributes."""

    attention: bool = False  # attention column scores, to `observe`
    window: int | None = None  # ... over the last `window` queries only (None: every query)
    reduce: str = "sum"  # "max": the largest probability a column got, not the sum
    columns: torch.Tensor | None = None  # with "max": [B, kv] bool, each query's softmax restricted to them
    queries: bool = False  # the forward's (RoPE-rotated) queries, to `observe_queries`


@dataclass
class Placement:
    """Writes for one forward. `src[b, h, i]` indexes the new tokens, `dest` is its slot (-1: dropped),
    `valid` whether that slot holds a real token afterwards. The head dim is 1 when all heads share a token set."""

    src: torch.Tensor
    dest: torch.Tensor
    valid: torch.Tensor
    #: host-side hints, so stores never read `dest` back from the device: the regions `dest` can land in (region
    #: stores), and `start` when dest is start, start + 1, ... for every row (append-only stores)
    regions: tuple | None = None
    start: int | None = None


class Policy(DeclaredState):
    """Base class. `capacity` is the fixed number of slots, or None for a growing cache. Every hook that takes a
    `view` is given the layer's `SlotView` (policies/view.py): what the policy may read and ask of its layer. Its
    per-row state is declared (`state`, `parts`: hf_kvcache.common.declared_state), from which batch mapping,
    reset and `nbytes` derive."""

    capacity: int | None = StaticInt()  # fixed for the cache's life: torch.compile specialises on it
    per_head = False  # True when each KV head keeps its own token set
    deferred = False  # True when multi-token chunks are placed only after attention (scores needed)
    needs_attention = False  # True when the bridge must hand attention column scores to `observe`
    attention_window: int | None = StaticInt()  # with needs_attention: column sums over the last w queries (None: all)
    attention_reduce = "sum"  # with needs_attention: "max" hands the largest probability a column got, not the sum
    score_columns: torch.Tensor | None = None  # with "max": [B, kv] bool, each query's softmax restricted to them
    needs_queries = False  # True when the bridge must hand the forward's (RoPE-rotated) queries to `observe_queries`
    reads_stored_keys = False  # True when it reads the stored keys itself (the store's dequantizing read)
    needs_positions = True  # False when the policy never reads the layer's per-slot position ids (keep-all)
    compileable = False  # True when its decode steps compile without graph breaks or per-step recompilation

    @property
    def needs(self) -> Needs:
        """What the bridge must hand over now (from the flags above)."""
        return Needs(
            self.needs_attention, self.attention_window, self.attention_reduce, self.score_columns, self.needs_queries
        )

    def configure(self, prompt_length: int) -> None:
        """Called once with the first forward's length (budgets given as ratios of the prompt resolve here)."""

    def size_for(self, heads: int) -> None:
        """Called after `configure` with the layer's KV heads (head-adaptive budgets size one pool for all of them)."""

    def allocate(self, batch: int, heads: int, device) -> None:
        """Create per-row state at the first update."""

    def begin(self, view, q: int) -> None:
        """Called at the start of every update with its number of new tokens, before any slot is sized or placed."""

    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        """real [B, q]: which of the q new tokens are real (not padding); seen: tokens before them."""
        raise NotImplementedError

    def used_after(self, seen: int) -> int:
        """Number of slot columns attention sees once `seen` tokens are in."""
        raise NotImplementedError

    def has_evicted(self, seen: int) -> bool:
        raise NotImplementedError

    # True when an unpadded stream can still leave invalid columns (then the bridge always applies the mask).
    may_have_holes = False

    def decode_slot(self, view, seen: int) -> int | None:
        """For an unpadded one-token step: the slot of the new token if it is the same for every row and head and
        known without reading data (the layer then takes a fast path), else None."""
        return None

    def after_decode_write(self, view, slot: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Bookkeeping after a fast-path write of one token into `slot`."""

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        """Called after the new tokens were written (keys are the written keys, dest their slots, seen_before the
        stream index of the first new token)."""

    def before_read(self, view) -> None:
        """Called before attention reads the store (e.g. to move keys to new positions)."""

    def observe(self, view, column_scores: torch.Tensor) -> None:
        """With `needs_attention`: the attention column scores [B, Hq, columns] of this forward (summed over its
        last `attention_window` queries, or their max with `attention_reduce` "max"); a deferred policy places its
        pending chunk here (`view.commit`)."""
        raise RuntimeError(f"{type(self).__name__} does not use attention scores")

    def observe_queries(self, view, query: torch.Tensor) -> None:
        """With `needs_queries`: this forward's queries [B, Hq, q, D] (RoPE-rotated), before attention."""
        raise RuntimeError(f"{type(self).__name__} does not use queries")

    def crop(self, view, new_seen: int) -> None:
        """Forget the tokens from stream index `new_seen` on; only called while nothing was evicted."""
        raise NotImplementedError(f"{type(self).__name__} does not support crop")


class ScorerHost(Policy):
    """A policy that hosts a scorer (hf_kvcache.scorers) in `self.scorer`: what the bridge hands over is what the
    scorer needs."""

    deferred = property(lambda self: self.scorer.deferred)
    needs_attention = property(lambda self: self.scorer.needs_attention)
    needs_queries = property(lambda self: self.scorer.needs_queries)
    attention_window = property(lambda self: self.scorer.attention_window)
    reads_stored_keys = property(lambda self: self.scorer.reads_stored_keys)
