"""Prompt eviction inside transformers' continuous batching: when a request's last prompt chunk has been written, each
layer keeps the prompt tokens its method ranks best (hf_kvcache.paged.prompt_scores), they are moved to the front of
the request's pages, and the pages past them go back to the pool at once, for other requests.

With a `chunk` (CompressSpec.chunk) a request is also compressed every `chunk` prompt tokens: the scheduler lets it
write at most what is left of its chunk per forward (hf_kvcache.integration.prefill_chunks), and each compression
keeps the whole prompt's budget (CompressSpec.kept_so_far), so the request never holds more than that plus a chunk.

Set by `kv_compress` on the continuous-batching config (hf_kvcache.paged.compress_spec), for every request, or per
request (`request_specs`, which `hf-kvcache serve` fills from a request's `kv_compress` field). Works on model-dtype
and quantized pages alike (the rows move as they are: codes and scales, or values).

How a request continues after its prompt was compressed from P to K tokens: transformers uses a request's
`position_offset` both as its length in the cache (where the next token is written, how many rows attention reads,
how many pages it needs) and as the position of its next token. The first becomes K; the positions of its later
tokens are shifted back up by P - K before each forward (`PagedEviction.before_forward`), so decoding continues at the
original positions (the kept keys carry their RoPE rotation already). Everything transformers derives from the length
(the pages allocated, admission, CPU offloading and restoring) follows the compressed length.

The scores are the method's registry scorer's `score` (hf_kvcache.scorers.base.Prompt); what it reads
(`Scorer.prompt_reads`) is captured during the forwards of the prompt (and nothing after it):
- "arrived" (kvzap): each layer's attention input hidden states (forward pre-hooks on the attention modules,
  hf_kvcache.integration.attention_inputs), scored chunk by chunk as they arrive (`Scorer.score_arrivals`);
- "queries" (snapkv): the queries of the prompt's last `attention_window` tokens, over its chunks (the batch
  attention wrapper, hf_kvcache.paged.codes_attention, hands them over), scored against the stored keys;
- "keys" (keydiff, knorm, snapkv): the stored keys, read when the prompt ends.

On head pages (`kv_compress_layout` "head", hf_kvcache.paged.head_pages) every (layer, KV head) keeps its own tokens,
allotted over the model and the heads by the scorer's per-head scores (hf_kvcache.paged.head_allotment), and the
request's `position_offset` becomes the average a head keeps.

A request whose scoring or compaction raises fails alone (its client gets the error, its pages go back), and a forward
that raises fails the requests of its batch only (hf_kvcache.paged.request_faults; the step around the forward:
hf_kvcache.paged.step).

Limits (each an error at start, never a silent fallback): models with sliding-window layers (their ring buffer would
need its own compaction), prefix sharing (a compacted page no longer holds the tokens its hash names: it is turned
off), async batching and CUDA graphs (the step is turned synchronous and graph-free, with the reason logged).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from ..integration import patches
from ..integration.attention_inputs import attention_modules, capture_attention_inputs
from ..integration.prefill_chunks import cap_prefill_chunks
from ..scorers.base import Prompt
from . import codes_attention
from .codes_attention import OBSERVE_KWARG
from .compress_spec import FIELD, CompressSpec
from .eviction_checks import check, for_model, layout_of, surrogate_for
from .head_compaction import compress_heads
from .page_rows import free_tail, read_keys, token_rows
from .prompt_scores import kept_positions, prompt_scorer, reads, token_scores
from .request_specs import LOCK, request_specs

logger = logging.getLogger(__name__)

#: the RequestState attribute that carries a request's compression (it follows the state through CPU offloading;
#: a soft reset builds a new state, whose prompt is prefilled and compressed again)
STATE_ATTR = "_hf_kvcache_compression"


@dataclass
class RequestCompression:
    """One request's compression: its spec, what was captured for its scores, and what it kept."""

    spec: CompressSpec
    arrived: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # "arrived": [Hkv, q] per chunk and layer
    queries: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)  # "queries": ([Hq, w, D], scaling)
    scorers: dict[int, object] = field(default_factory=dict)  # the method's scorer per layer, until compressed
    prompt: int | None = None  # tokens prefilled, once compressed
    kept: int | None = None
    shift: int = 0  # position of a later token minus its index in the cache (prompt tokens seen - rows held)
    compacted: int = 0  # rows held right after the last compression (spec.chunk: those before this chunk)
    # head pages, chunk by chunk: per layer, the arrival scores of the tokens each head kept ([n_h] per head)
    head_arrived: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class EvictionStats:
    """Totals over the requests whose prompt ended (GET /v1/kv_cache)."""

    requests: int = 0  # prompts ended
    requests_compressed: int = 0
    tokens_prefilled: int = 0
    tokens_kept: int = 0
    pages_freed: int = 0

    def to_dict(self) -> dict:
        return dict(vars(self))


class _Current(threading.local):
    eviction: PagedEviction | None = None


_current = _Current()
_HOOKED = "_hf_kvcache_paged_eviction_hooks"
#: what a scorer reads of a prompt that only its forwards compute (the attention inputs, the queries)
CAPTURED = frozenset({"arrived", "queries"})


def _route_attention_input(layer_idx: int, hidden: torch.Tensor) -> None:
    eviction = _current.eviction
    if eviction is not None:
        eviction.attention_input(layer_idx, hidden)


@dataclass
class _Capture:
    """A request of the current forward whose scores need what the forward computes."""

    state: object  # its RequestState
    info: RequestCompression
    start: int  # its first query in the packed batch
    length: int  # its queries


class PagedEviction:
    """The prompt eviction of one paged cache (see the module docstring). `cache` is the PagedAttentionCache,
    `default` the spec of requests that name none (None: only those that ask are compressed)."""

    def __init__(self, cache, default: CompressSpec | None, config, cb_config):
        default = for_model(default, config)  # (a spec naming no method: the model's default)
        check(default, config, cache.cache_allocators)
        self.cache, self.default, self.config = cache, default, config
        #: request id -> spec (None: not compressed) for requests that name their own; consumed at their first forward
        self.request_specs: dict[str, CompressSpec | None] = request_specs(cb_config)
        self.stats = EvictionStats()
        #: "head": pages of one (layer, head), each its own budget (hf_kvcache.paged.head_pages); else "token"
        self.layout = layout_of(cache.cache_allocators)
        #: the requests a step failed (hf_kvcache.paged.request_faults: each fails alone, the loop goes on)
        self.faults = cache.faults
        self._captures: list[_Capture] = []
        self._lock = LOCK
        # the specs requests named, for a request restarted by a soft reset (a new state prefilled again); pruned
        # of requests the scheduler no longer holds
        self._named: dict[str, CompressSpec | None] = {}
        self._forwards = 0
        # a compacted page no longer holds the tokens its hash names
        cache.allow_block_sharing = cache.use_prefix_sharing = False
        if getattr(cb_config, "use_async_batching", None):
            logger.info("%s: async batching turned off (pages move between two forwards)", FIELD)
        cb_config.use_async_batching = False
        if torch.device(cache.device).type != "cpu" and getattr(cb_config, "use_cuda_graph", None) is not False:
            logger.info("%s: CUDA graphs turned off (scores are captured during the prompt's forwards)", FIELD)
            cb_config.use_cuda_graph = False
        codes_attention.install()  # snapkv's queries come through the batch attention wrapper

    # -- which requests -------------------------------------------------------------------------------------------
    def set_request_spec(self, request_id: str, spec: CompressSpec | None) -> None:
        """Request `request_id` keeps its prompt by `spec` (None: not compressed) instead of the default; raises
        ValueError when `spec` cannot run here."""
        spec = for_model(spec, self.config)
        check(spec, self.config, self.cache.cache_allocators)
        with self._lock:
            self.request_specs[request_id] = spec

    def prefill_cap(self, state) -> int | None:
        """(the scheduler) The most prompt tokens `state` may write in its next forward: what is left of its `chunk`
        since its last compression (None: no cap)."""
        info = getattr(state, STATE_ATTR) if hasattr(state, STATE_ATTR) else self._start(state)
        chunk = None if info is None or info.kept is not None else info.spec.every()
        return None if chunk is None else chunk - (state.position_offset - info.compacted)

    def _start(self, state) -> RequestCompression | None:
        request_id = state.request_id
        with self._lock:
            if request_id in self.request_specs:
                self._named[request_id] = for_model(self.request_specs.pop(request_id), self.config)
        spec = self._named.get(request_id, self.default)
        info = None if spec is None or getattr(state, "num_children", 0) else RequestCompression(spec)
        if spec is not None and info is None:
            logger.warning("%s: request %s is forked (parallel sampling) and keeps its prompt", FIELD, state.request_id)
        setattr(state, STATE_ATTR, info)
        return info

    # -- around a forward ------------------------------------------------------------------------------------------
    def before_forward(self, processor, model) -> None:
        """Shift the positions of compressed requests' tokens; note what this forward must capture for scores."""
        _current.eviction = self
        self._captures = []
        batch = processor.inputs_and_outputs.requests_in_batch
        shifts, lengths, start = [], [], 0
        for future in batch:
            state, length = future.state, future.query_length
            info = getattr(state, STATE_ATTR, None)
            if state.position_offset == length:  # its first forward (or again after a soft reset)
                info = self._start(state)
            if info is not None and info.kept is None and CAPTURED & set(reads(info.spec.method)):
                self._captures.append(_Capture(state, info, start, length))
            shifts.append(0 if info is None else info.shift)
            lengths.append(length)
            start += length
        if self.layout == "head":  # the rows each stream writes and reads are planned from this batch
            allocator = next(iter(self.cache.cache_allocators.values()))
            allocator.set_batch([(future.state.request_id, future.query_length) for future in batch])
        if any(shifts):
            per_token = torch.repeat_interleave(torch.tensor(shifts), torch.tensor(lengths))
            positions = processor.inputs_and_outputs.position_ids
            positions[:start] += per_token.to(positions.device, positions.dtype, non_blocking=True)
        if any("arrived" in reads(c.info.spec.method) for c in self._captures):
            self._hook(model)

    def _hook(self, model) -> None:
        modules = [module for _, module in attention_modules(model)]
        if not all(getattr(module, _HOOKED, False) for module in modules):
            capture_attention_inputs(model, _route_attention_input)  # once per model, for every paged cache
            for module in modules:
                setattr(module, _HOOKED, True)

    def attention_input(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """(the attention-input hooks) Score the prompt tokens of this forward as they arrive ("arrived": KVzap)."""
        for capture in list(self._captures):
            if "arrived" in reads(capture.info.spec.method):
                try:
                    scorer = self._scorer(capture.info, layer_idx)
                    chunk = hidden[:, capture.start : capture.start + capture.length]
                    capture.info.arrived.setdefault(layer_idx, []).append(scorer.score_arrivals(chunk)[0])
                except Exception as error:
                    self._fail(capture, f"scoring its prompt at layer {layer_idx}", error)

    def _scorer(self, info: RequestCompression, layer_idx: int):
        """The request's scorer of layer `layer_idx`, built once (every forward of its prompt asks for it)."""
        if layer_idx not in info.scorers:
            spec = info.spec
            surrogate = surrogate_for(spec, self.config) if "arrived" in reads(spec.method) else None
            info.scorers[layer_idx] = prompt_scorer(spec, layer_idx, surrogate)
        return info.scorers[layer_idx]

    def layer_kwargs(self, layer_idx: int, kwargs: dict) -> None:
        """(the cache's update) Ask the layer's attention function for its queries ("queries": SnapKV)."""
        if any("queries" in reads(c.info.spec.method) for c in self._captures):
            kwargs[OBSERVE_KWARG] = lambda query, scaling: self._observe(layer_idx, query, scaling)

    def _observe(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        """query [1, Hq, total_q, D]: keep the scorer's last `attention_window` queries of each prompt so far (a
        chunk shorter than the window adds to the previous chunks' queries: the window is the prompt's, however it was
        chunked)."""
        for capture in list(self._captures):
            info = capture.info
            if "queries" not in reads(info.spec.method):
                continue
            try:
                end = capture.start + capture.length
                w = int(self._scorer(info, layer_idx).attention_window)
                tail = query[0, :, max(capture.start, end - w) : end]
                if layer_idx in info.queries and tail.shape[1] < w:
                    tail = torch.cat((info.queries[layer_idx][0], tail), 1)[:, -w:]
                info.queries[layer_idx] = (tail.clone(), scaling)
            except Exception as error:
                self._fail(capture, f"capturing its queries at layer {layer_idx}", error)

    def _fail(self, capture: _Capture, stage: str, error: Exception) -> None:
        """A capture that raised: its request fails after this step (request_faults); the others go on."""
        self.faults.record(capture.state, stage, error)
        self._captures.remove(capture)

    def after_forward(self, processor) -> None:
        """Compress the requests whose prompt this forward ended (before transformers reads the new tokens)."""
        _current.eviction = None
        self._captures = []
        self._forwards += 1
        if self._named and self._forwards % 256 == 0:
            scheduler = processor.scheduler
            held = set(scheduler.active_requests) | set(scheduler.waiting_requests)
            self._named = {rid: spec for rid, spec in self._named.items() if rid in held}
        for future in processor.inputs_and_outputs.requests_in_batch:
            state = future.state
            info = getattr(state, STATE_ATTR, None)
            if (info is not None and info.kept is not None) or self.faults.failed(state):
                continue  # compressed already, or failed in this step
            try:
                self._after_forward(future, state, info)
            except Exception as error:
                self.faults.record(state, "compressing its prompt", error)

    def _after_forward(self, future, state, info: RequestCompression | None) -> None:
        if not future.has_new_token or state.generated_len() != 0:
            chunk = None if info is None else info.spec.every()
            if chunk is not None and state.position_offset - info.compacted >= chunk:
                self._compress(state, info, final=False)
            return
        self.stats.requests += 1
        if info is None:
            self.stats.tokens_prefilled += state.position_offset
            self.stats.tokens_kept += state.position_offset
            return
        self._compress(state, info, final=True)

    def abandon(self) -> None:
        _current.eviction = None
        self._captures = []

    # -- the compaction ---------------------------------------------------------------------------------------------
    def _compress(self, state, info: RequestCompression, final: bool) -> None:
        """Keep the prompt's budget of the `seen` prompt tokens so far (spec.kept_so_far): at the prompt's end
        (`final`), or every `chunk` prompt tokens (spec.chunk). The rows held are the kept ones of earlier
        compressions, then the newer ones. The prompt is what transformers prefills (`initial_tokens`: a request
        restarted by a soft reset prefills its prompt and what it generated)."""
        spec, request_id = info.spec, state.request_id
        held = state.position_offset
        seen = info.shift + held
        kept = min(spec.kept_so_far(seen, len(state.initial_tokens)), held)
        freed = 0
        if kept < held and self.layout == "head":
            freed, kept = self._compress_heads(state, info, held, kept)
            state.position_offset = kept
        elif kept < held:
            for allocator in self.cache.cache_allocators.values():
                rows = torch.tensor(allocator.get_read_indices(request_id, 0, held), device=self.cache.device)
                for layer_idx in allocator.layer_indices:
                    scorer = self._scorer(info, layer_idx)
                    scores = token_scores(scorer, self._prompt(info, allocator, layer_idx, rows))
                    positions = kept_positions(spec, held, scores, device=rows.device, kept=kept)
                    src, dest = rows[positions], rows[:kept]
                    for view in token_rows(allocator, layer_idx):
                        view.index_copy_(0, dest, view.index_select(0, src))  # read all before writing
                    if layer_idx in info.arrived:  # chunk by chunk: the kept rows' arrival scores carry on
                        info.arrived[layer_idx] = [torch.cat(info.arrived[layer_idx], -1)[:, positions]]
                freed += free_tail(allocator, request_id, kept)
            state.position_offset = kept
        info.shift, info.compacted = seen - kept, kept
        self.stats.pages_freed += freed
        if not final:
            return
        info.prompt, info.kept = seen, kept
        info.arrived, info.queries, info.scorers, info.head_arrived = {}, {}, {}, {}
        self.stats.tokens_prefilled += seen
        self.stats.tokens_kept += kept
        self.stats.requests_compressed += 1 if kept < seen else 0

    def _compress_heads(self, state, info: RequestCompression, held: int, kept: int) -> tuple[int, int]:
        """Head pages: each (layer, head) keeps its own tokens (hf_kvcache.paged.head_compaction). Returns (pages
        freed, tokens kept per head on average: the request's `position_offset`)."""
        return compress_heads(self, state, info, kept)

    def _prompt(
        self, info: RequestCompression, allocator, layer_idx: int, rows: torch.Tensor, keys: torch.Tensor | None = None
    ) -> Prompt:
        """What the method's scorer reads of the `rows` held (`prompt_reads`), from the pages and the captures."""
        wanted = reads(info.spec.method)
        fields = {}
        if "arrived" in wanted:
            chunks = info.arrived.get(layer_idx)
            if not chunks or sum(c.shape[-1] for c in chunks) != rows.numel():
                raise RuntimeError(
                    f"{FIELD}: {info.spec.method} scored {sum(c.shape[-1] for c in chunks or [])} of the prompt's "
                    f"{rows.numel()} tokens at layer {layer_idx}"
                )
            fields["arrived"] = torch.cat(chunks, -1)
        if "keys" in wanted:
            fields["keys"] = keys if keys is not None else read_keys(allocator, layer_idx, rows).transpose(0, 1)
        if "queries" in wanted:
            if layer_idx not in info.queries:
                raise RuntimeError(
                    f"{FIELD}: {info.spec.method} saw no queries at layer {layer_idx} (the attention function was "
                    "not the batch attention wrapper)"
                )
            fields["queries"], fields["scaling"] = info.queries[layer_idx]
        return Prompt(**fields)


def _prefill_cap(scheduler, state) -> int | None:
    eviction = getattr(scheduler.cache, "eviction", None)
    return None if eviction is None else eviction.prefill_cap(state)


def install() -> None:
    """Cap continuous batching's prompt chunks (idempotent): the `eviction` patches. The generation step eviction
    runs in is hf_kvcache.paged.step's, which the cache installs (required) before this."""
    patches.install(patches.EVICTION)
    cap_prefill_chunks(_prefill_cap)


__all__ = ["EvictionStats", "PagedEviction", "RequestCompression", "install"]
