"""One request's fault is one request's error: a failure in the work a paged cache of ours (quantized pages or
`kv_compress`) does for one request fails that request, and the continuous-batching loop goes on with the others.

transformers' generation loop treats any exception of a generation step as fatal: it stops the loop and fails every
request, active and waiting, and a server then answers 503 to everything after. Prompt eviction does work per request
inside and after the forward (hf_kvcache.paged.eviction), so:
- a request whose scoring (during the forward: KVzap's arrivals, SnapKV's queries) or compaction (after it) raises is
  recorded (`StepFaults.record`) and left out of the rest of the step's work; once transformers' `update_batch` has
  taken the step's tokens, it is failed (`fail_recorded`): its client gets the error (HTTP 500, or an error event on
  a stream), its pages go back to the pool;
- a forward that raises (attention from the codes, the model) cannot be told apart by request: the requests of that
  batch are failed (`forward_failed`, from the step: hf_kvcache.paged.step), the step's update is skipped (it has no
  tokens), and the loop goes on with the requests that were not in it (synchronous batching; with async batching the
  next batch is already in flight, and the fault stays fatal).
Where transformers' internals for failing one request changed (`REQUEST_FAULTS`), the error propagates as
transformers would have it (fatal), never silently swallowed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..integration import patches
from ..integration.continuous_batching import REQUEST_FAULTS, fail_request, requests_in_batch
from ..integration.contracts import holds
from .compress_spec import FIELD

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """What the client of a request that failed in a cache's work for it gets."""


@dataclass
class StepFaults:
    """The requests a generation step failed: by request id, (state, error), to fail once the step's tokens are
    taken; `forward`: the forward itself failed (its requests failed already, no update follows)."""

    requests: dict[str, tuple[object, RequestFailed]] = field(default_factory=dict)
    forward: bool = False

    def record(self, state, stage: str, error: Exception) -> None:
        """Request `state` failed while `stage` (e.g. 'scoring its prompt'); the first fault of a request wins.
        Raises `error` again where transformers' way of failing one request changed."""
        if not holds(REQUEST_FAULTS):
            raise error
        if state.request_id in self.requests:
            return
        logger.error("%s: request %s failed %s", FIELD, state.request_id, stage, exc_info=error)
        failure = RequestFailed(
            f"{FIELD}: request {state.request_id} failed {stage}: {type(error).__name__}: {error}. The other "
            "requests go on."
        )
        failure.__cause__ = error
        self.requests[state.request_id] = (state, failure)

    def failed(self, state) -> bool:
        return state.request_id in self.requests

    def forward_failed(self, processor, error: Exception) -> None:
        """The step's forward raised `error`: fail the requests of its batch (raises `error` again where
        transformers' way of failing one request changed)."""
        if not holds(REQUEST_FAULTS) or processor.use_async_batching:  # (async: the next batch is in flight)
            raise error
        batch = [future.state for future in requests_in_batch(processor)]
        logger.error("%s: a forward of %d requests failed", FIELD, len(batch), exc_info=error)
        for state in batch:
            failure = RequestFailed(
                f"the forward of this request's batch ({len(batch)} requests) failed: {type(error).__name__}: "
                f"{error}. The requests of other batches go on."
            )
            failure.__cause__ = error
            fail_request(processor, state, failure)
        self.requests.clear()
        self.forward = True

    def fail_recorded(self, processor) -> None:
        """(after the step's update) Fail the recorded requests that are still held."""
        faults, self.requests = self.requests, {}
        for request_id, (state, failure) in faults.items():
            if request_id in processor.scheduler.active_requests:
                fail_request(processor, state, failure)


def _with_request_faults(original):
    def update_batch(self):
        faults = getattr(self.cache, "faults", None)
        if faults is None:
            return original(self)
        if faults.forward:  # the forward failed: its requests were failed, there are no tokens to take
            faults.forward = False
            return None
        original(self)
        faults.fail_recorded(self)
        return None

    update_batch.__doc__ = (
        "transformers' update_batch, then the requests whose eviction failed in this step are failed "
        "(hf_kvcache.paged.request_faults)."
    )
    update_batch.__wrapped__ = original
    return update_batch


patches.provide("ContinuousBatchProcessor.update_batch", _with_request_faults)  # (applied by step.install)

__all__ = ["RequestFailed", "StepFaults"]
