"""How many prompt tokens transformers' continuous-batching scheduler lets a request write in one forward, capped per
request (prompt eviction's `chunk`, hf_kvcache.paged.eviction): transformers splits a prompt only at the batch's token
budget, so without a cap a request asks for pages for its whole remaining prompt at once.

It relies on the scheduler's two steps for each candidate request (`scheduler.Scheduler`):
`_infer_request_tokens(state, ids)` returns the tokens the request would write (its remaining prompt while it
prefills), whose length (at most the token budget) is what `cache.can_store_request_tokens` must find pages for; then
`_schedule_request(state, request_tokens, token_budget, ids)` writes `request_tokens[:token_budget]` this forward and
keeps the rest in `state.remaining_prefill_tokens`. The cap shortens the first and lowers the second's budget: the
wrappers are defined here and applied by hf_kvcache.integration.patches (group `eviction`).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.continuous_batching.requests import RequestStatus

from .contracts import contract, parameters, require, source

PREFILL_CHUNKS = "Scheduler._infer_request_tokens / _schedule_request (a prompt split at the token budget)"
#: the cap in force (cap_prefill_chunks sets it): (scheduler, state) -> the most prompt tokens per forward, or None
_CAP: list[Callable | None] = [None]


@contract(
    PREFILL_CHUNKS,
    "Scheduler._process_candidates asks can_store_request_tokens(state, min(len(request_tokens), token_budget)) "
    "for request_tokens = _infer_request_tokens(state, ids) (the remaining prompt while prefilling), then calls "
    "_schedule_request(state, request_tokens, token_budget, ids), which writes request_tokens[:token_budget] and "
    "keeps the rest in state.remaining_prefill_tokens",
    "prompt eviction chunk by chunk (kv_compress chunk=...)",
)
def _check_prefill_chunks() -> str | None:
    scheduler = cb_scheduler.Scheduler
    for name, expected in (
        ("_infer_request_tokens", ["self", "state", "request_ids_to_remove_from_waiting"]),
        (
            "_schedule_request",
            ["self", "state", "request_tokens", "token_budget", "request_ids_to_remove_from_waiting"],
        ),
    ):
        found = parameters(getattr(scheduler, name, None))
        if found != expected:
            return f"Scheduler.{name} takes {found}, expected {expected}"
    candidates = source(scheduler._process_candidates)
    for needle in (
        "request_tokens = self._infer_request_tokens(state,",
        "request_len = min(len(request_tokens), token_budget)",
        "self.cache.can_store_request_tokens(state, request_len)",
        "self._schedule_request(state, request_tokens, token_budget,",
    ):
        if needle not in candidates:
            return f"Scheduler._process_candidates no longer contains `{needle}`"
    split = source(scheduler._schedule_request)
    if "state.remaining_prefill_tokens = request_tokens[token_budget:]" not in split:
        return "Scheduler._schedule_request no longer splits a prompt at token_budget"
    return None


def cap_prefill_chunks(cap_of: Callable) -> None:
    """From now on, a prefilling request writes at most `cap_of(scheduler, state)` prompt tokens per forward (None:
    no cap; `cap_of` replaces the previous one). Takes effect where the scheduler's two steps are wrapped (the
    `eviction` patches: `capped_infer_request_tokens`, `capped_schedule_request`)."""
    require(PREFILL_CHUNKS)
    _CAP[0] = cap_of


def capped_infer_request_tokens(infer):
    """transformers' `Scheduler._infer_request_tokens` (`infer`), its tokens cut at the cap."""

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting):
        tokens = infer(self, state, request_ids_to_remove_from_waiting)
        cap = _cap(self, state)
        return tokens if cap is None else tokens[:cap]

    _infer_request_tokens.__doc__ = f"{infer.__doc__}\n\n(hf_kvcache: capped per request, {__name__})"
    return _infer_request_tokens


def capped_schedule_request(split):
    """transformers' `Scheduler._schedule_request` (`split`), splitting the remaining prompt at the cap."""

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting):
        cap = _cap(self, state)
        if cap is not None:  # the whole remaining prompt, split at the cap (or the budget, if lower)
            request_tokens, token_budget = state.remaining_prefill_tokens, min(token_budget, cap)
        return split(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    _schedule_request.__doc__ = f"{split.__doc__}\n\n(hf_kvcache: capped per request, {__name__})"
    return _schedule_request


def _cap(scheduler, state) -> int | None:
    """The cap on what `state` writes this forward: only while it prefills, and only below its remaining prompt."""
    cap_of = _CAP[0]
    if cap_of is None or state.status not in (RequestStatus.PENDING, RequestStatus.PREFILLING):
        return None
    cap = cap_of(scheduler, state)
    if cap is None or cap >= len(state.remaining_prefill_tokens):
        return None
    if cap < 1:
        raise RuntimeError(f"prefill cap {cap} for request {state.request_id}: a request must write a token")
    return cap


__all__ = ["PREFILL_CHUNKS", "cap_prefill_chunks", "capped_infer_request_tokens", "capped_schedule_request"]
