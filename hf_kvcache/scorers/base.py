"""The scorer contract: what ranks tokens, written once and used by every policy that keeps the best-scoring ones.

A scorer maps what it reads (the keys, the values, the forward's queries, the attention the tokens received, or a
model's own forwards, as KVzip's reconstruction) to one score per token and KV head, higher = more worth keeping. It
never places a token: its *host* does, the policy that owns the per-slot scores and chooses the survivors.
- `HeavyHitterPolicy` / `ScoredPolicy` (policies/heavy_hitter.py, policies/scored.py): the standalone caches (H2O,
  random eviction, the scorer caches, KVzip's placement) and prompt mode;
- `CompositePolicy` (policies/composite.py): the heavy region of CompositeCache.

A scorer is a dataclass: its parameters are fields (validated once, in `__post_init__`), its state fields are
declared with `state()` (per batch row: map_batch reorders them) or `slot_state()` (tensors [B, Hm, X, slots + 1]
whose last dim follows the tokens' slots: `move` carries them), and `map_batch`, `reset`, `nbytes` derive from those
declarations. What it needs from the attention bridge it declares as class attributes (`needs_attention`,
`attention_window`, `needs_queries`, `reads_stored_keys`); its host exposes them to the bridge.

The host gives itself (`host`) and the layer's `SlotView` to every hook; a scorer reads and writes `host.scores`
[B, Hm, slots + 1] (float32), and may read `host.stream` (stream index per slot), `host.capacity` and
`host.sink_slots` (slots before the scored ones that are never candidates: the composite's sinks region). The hooks,
one per moment of a forward:
- `chunk_scores(host, view, real, seen)`: a multi-token forward of a scorer that needs neither attention nor
  queries (placed at once): the new tokens' scores [B, Hm, q]; it may re-score the stored ones in `host.scores`.
- `observe(host, view, column_scores)` / `observe_queries(host, view, query)`: from the bridge. In decode (no pending
  chunk) they update the stored scores and return None; for a pending chunk they update the stored tokens' scores
  and return the scores [B, Hm, used + q] of the stored and the new tokens (the host then places the chunk).
- `before_selection(host, view, real)`: a decode step in which a selection is due (scorers with `rescores`): scorers
  whose scores are relative to the current candidates re-score the stored tokens here.
- `arrival(host, view, placement, keys, dest, seen_before)`: after the new tokens were written to slots `dest`:
  their scores (None: 0 until `observe` or the next selection sets them), and any per-slot state for them.
- `move(src, dest)`: the host moved tokens from slots `src` to `dest` [B, Hm, n]: per-slot state follows them.

A whole prompt, seen by one forward (continuous batching's `kv_compress`, hf_kvcache.paged.eviction), is scored by
`score(prompt)`: a pure function of a `Prompt` (the layer's keys, the prompt's last queries, the scores its tokens got
on arrival) to scores [Hkv, P], kvpress's `score()` shape. A scorer that can declares `prompt_reads` and writes
`score` beside its hooks, from the same functions (knorm_scores, keydiff_scores, SnapKV's pooling), and it is then a
`kv_compress` method too (tests/test_prompt_scoring_contract.py: `score` keeps per head what the hooks keep in
prompt mode; tests/test_new_scorer.py adds a scorer in a module and a registry line, and serves with it).

Adding a scorer is one module here and one line in `registry.py`; the caches, the composite, serving's `kv_compress`,
the tests and the docs table read the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from ..common.compile_static import StaticInt, fixed_shape

STATE = "state"


def state(default=None):
    """A per-batch-row state field (None until first use; `reset` puts the default back)."""
    return dataclasses.field(default=default, init=False, repr=False, compare=False, metadata={STATE: "row"})


def slot_state():
    """A per-slot state tensor [B, Hm, X, slots + 1]: `move` carries its columns with the tokens."""
    return dataclasses.field(default=None, init=False, repr=False, compare=False, metadata={STATE: "slot"})


def bound(default=None):
    """A field its host or cache sets from the model (a RoPE rotator, a tensor-parallel group), never a config key."""
    return dataclasses.field(default=default, repr=False, compare=False, metadata={"bound": True})


def group_mean(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, n] -> [B, Hkv, n]: mean over the query heads of each KV group (GQA, as kvpress averages)."""
    batch, q_heads, n = scores.shape
    return scores.view(batch, kv_heads, q_heads // kv_heads, n).mean(2)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request's prompt as one layer's forwards saw it: what `Scorer.score` reads (`prompt_reads` says which)."""

    #: [Hkv, P, D] the keys as attention reads them (RoPE-rotated); "keys"
    keys: torch.Tensor | None = None
    #: [Hq, w, D] the queries of the prompt's last w tokens (w = the scorer's `attention_window`); "queries"
    queries: torch.Tensor | None = None
    #: the attention's softmax scaling of those queries
    scaling: float = 1.0
    #: [Hkv, P] the scores each token got when it arrived (`score_arrivals`, e.g. KVzap's from the attention inputs)
    arrived: torch.Tensor | None = None


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _mapped(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(fn(t) if isinstance(t, torch.Tensor) else t for t in value)
    return value


@dataclasses.dataclass(eq=False)
class Scorer:
    """Base class: no scores (the hooks do nothing). See the module docstring for the contract."""

    #: the registered name (registry.py); also what a config's "scorer" field says
    name: ClassVar[str] = ""
    #: the bridge hands attention column scores to `observe` (over the last `attention_window` queries; None: all)
    needs_attention: ClassVar[bool] = False
    attention_window = StaticInt()  # torch.compile specialises on it (hf_kvcache.common.compile_static)
    #: the bridge hands the forward's (RoPE-rotated) queries to `observe_queries`
    needs_queries: ClassVar[bool] = False
    #: it reads the stored keys itself (the store's dequantizing read), whatever attention reads
    reads_stored_keys: ClassVar[bool] = False
    #: `before_selection` re-scores the stored tokens (called before each decode selection)
    rescores: ClassVar[bool] = False
    #: decode steps compile whole (no data-dependent layout in its hooks)
    compileable: ClassVar[bool] = False
    #: it needs model forwards of its own before placing (KVzip's reconstruction): only its cache can run it
    needs_model_forwards: ClassVar[bool] = False
    #: it reads the layer's attention input hidden states (KVzap): only its cache hooks the attention modules
    needs_attention_inputs: ClassVar[bool] = False
    #: a row of a (left-padded) batch scores as it would alone (random draws are keyed by batch row and stream index)
    row_independent: ClassVar[bool] = True
    #: what it reads, in words (the docs' scorer table)
    reads: ClassVar[str] = "nothing"
    #: settings that let it rank the few tokens of a tiny test model (the registry's tests and support matrix)
    small: ClassVar[dict] = {}
    #: what `score` reads of a `Prompt`: "keys", "queries", "arrived" (empty: it cannot score a prompt on its own)
    prompt_reads: ClassVar[tuple[str, ...]] = ()
    #: how pages that hold every KV head of a token reduce its heads' scores to one: "max" (attention: a token some
    #: head needs stays) or "mean" (key geometry, whose per-head scales differ)
    head_reduction: ClassVar[str] = "max"

    @property
    def deferred(self) -> bool:
        """Chunks are placed after the bridge hands over what the scores need."""
        return self.needs_attention or self.needs_queries

    # -- a whole prompt (see the module docstring) ------------------------------------------------------------------
    def score(self, prompt: Prompt) -> torch.Tensor:
        """Scores [Hkv, P] of a whole prompt, higher = keep (scorers with `prompt_reads`)."""
        raise NotImplementedError(f"scorer {self.name!r} does not score a prompt on its own")

    def score_arrivals(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [B, Hkv, q] of tokens as they arrive, from the layer's attention inputs [B, q, d] ("arrived")."""
        raise NotImplementedError(f"scorer {self.name!r} does not score attention inputs")

    # -- hooks (see the module docstring) -------------------------------------------------------------------------
    def allocate(self, host, batch: int, heads: int, device) -> None:
        """Per-row setup at the host's first update."""

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor | None:
        return None

    def observe(self, host, view, column_scores: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"scorer {self.name!r} does not use attention scores")

    def observe_queries(self, host, view, query: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError(f"scorer {self.name!r} does not use queries")

    def before_selection(self, host, view, real: torch.Tensor) -> None:
        pass

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        return None

    # -- declared state -------------------------------------------------------------------------------------------
    def _state_fields(self, kind: str | None = None):
        return [
            f for f in dataclasses.fields(self) if STATE in f.metadata and (kind is None or f.metadata[STATE] == kind)
        ]

    def slot_tensor(self, host, width: int, fill: float = 0.0) -> torch.Tensor:
        """A new per-slot state tensor [B, Hm, width, slots + 1] shaped after `host.scores`."""
        batch, heads, slots = host.scores.shape
        tensor = host.scores.new_full((batch, heads, width, slots), fill)
        fixed_shape(tensor)
        return tensor

    def move(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        for f in self._state_fields("slot"):
            tensor = getattr(self, f.name)
            if tensor is None:
                continue
            width = tensor.shape[2]
            moved = tensor.gather(3, src[:, :, None].expand(-1, -1, width, -1))  # all read before any write
            tensor.scatter_(3, dest[:, :, None].expand(-1, -1, width, -1), moved)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for f in self._state_fields():
            setattr(self, f.name, _mapped(getattr(self, f.name), fn))

    def reset(self) -> None:
        for f in self._state_fields():
            setattr(self, f.name, f.default)

    def nbytes(self) -> int:
        return sum(t.nbytes for f in self._state_fields() for t in _tensors(getattr(self, f.name)))


@dataclasses.dataclass(eq=False)
class CandidateScorer(Scorer):
    """A scorer whose scores are relative to the candidate set (KeyDiff's anchor, LagKV's partitions): every
    selection re-scores the stored tokens and the incoming ones together (`candidates`), a chunk at once, a decode
    step before its selection. Subclasses write `candidates` only."""

    reads_stored_keys: ClassVar[bool] = True
    rescores: ClassVar[bool] = True

    _chunk_scores: torch.Tensor | None = state()  # a chunk's new tokens' scores, until they are written

    def candidates(self, host, view, real: torch.Tensor, n_stored: int, seen: int) -> torch.Tensor:
        """Scores [B, Hm, n_stored + q] of the first `n_stored` slots and the incoming tokens (stream index `seen`
        on)."""
        raise NotImplementedError

    def chunk_scores(self, host, view, real: torch.Tensor, seen: int) -> torch.Tensor:
        used = view.used
        scores = self.candidates(host, view, real, used, seen)
        host.scores[..., :used] = scores[..., :used]
        self._chunk_scores = scores[..., used:]
        return self._chunk_scores

    def before_selection(self, host, view, real: torch.Tensor) -> None:
        c = host.capacity
        host.scores[..., :c] = self.candidates(host, view, real, c, view.seen)[..., :c]

    def arrival(self, host, view, placement, keys: torch.Tensor, dest: torch.Tensor, seen_before: int):
        if self._chunk_scores is None:  # decode: scored by the next selection
            return None
        scores = self._chunk_scores.gather(2, placement.src.expand(dest.shape))
        self._chunk_scores = None
        return scores
