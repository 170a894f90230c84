"""How many requests a continuous-batching run held at once when its KV memory was the limit.

transformers' FIFO scheduler, at every forward, schedules the decoding requests, then admits waiting requests until
the forward's token budget (`max_batch_tokens`) or its request limit runs out or the cache refuses one (below its
safety margin of free memory, or a page allocation fails). The recorder (hf_kvcache.evaluation.agreement) keeps one
`ForwardRecord` per forward; `admission_limit` says which of ADMISSION_LIMITS stopped admission there.

With every request submitted at once, a run has three phases, and only the middle one measures what the memory
holds:
- the fill: the empty cache takes prompts at `max_batch_tokens` per forward, so a larger pool takes more forwards
  to fill, and its first requests have grown (or finished) meanwhile: the number resident when memory first
  refuses depends on the pool size and the token budget, not on the memory alone;
- the steady state: from the forward at which every request resident when memory first refused admission has left
  the cache (every resident request was then admitted under memory pressure) to the last forward with a request
  still waiting;
- the drain: the queue is empty, residents finish, memory has room.

`steady_state(records)` returns the concurrency of the middle phase: requests resident at the forwards where the
cache refused a waiting request (mean, peak, how many forwards), pages per such request, and the share of the
phase's forwards that were memory-bound. A run that never reaches it (the queue runs dry first, or memory never
refuses a request) gets `measured=False`, and the reason.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

#: what stopped the scheduler admitting waiting requests at a forward (derived from the batch it built):
#: "no waiting request" (the queue is empty), "batch tokens" (the forward's token budget is used up), "requests per
#: batch" (its request limit), "memory" (requests are waiting and budgets are left: the cache refused them)
ADMISSION_LIMITS = ("no waiting request", "batch tokens", "requests per batch", "memory")


@dataclass(frozen=True)
class ForwardRecord:
    """The cache and the scheduler at one forward of a continuous-batching run."""

    resident: frozenset[str]  # ids of the requests holding pages (full-attention block tables)
    pages_in_use: int  # pages those requests hold (blocks of the first allocator: page_size tokens of every layer)
    waiting_requests: int  # submitted requests not admitted yet (including evicted ones, requeued)
    batch_requests: int
    batch_tokens: int  # query tokens of the forward
    admission_limit: str  # one of ADMISSION_LIMITS

    @property
    def resident_requests(self) -> int:
        return len(self.resident)

    def as_row(self) -> dict:
        """JSON-friendly (request ids dropped)."""
        return {
            "resident_requests": self.resident_requests,
            "pages_in_use": self.pages_in_use,
            "waiting_requests": self.waiting_requests,
            "batch_requests": self.batch_requests,
            "batch_tokens": self.batch_tokens,
            "admission_limit": self.admission_limit,
        }


def admission_limit(
    waiting: int, batch_tokens: int, max_batch_tokens: int, batch_requests: int, max_requests_per_batch: int
) -> str:
    """Which limit stopped admission at a forward (see ADMISSION_LIMITS): the scheduler fills the token budget
    (splitting a prompt that does not fit) unless the cache refuses a request or the request limit is reached."""
    if waiting == 0:
        return "no waiting request"
    if batch_tokens >= max_batch_tokens:
        return "batch tokens"
    if batch_requests >= max_requests_per_batch:
        return "requests per batch"
    return "memory"


def steady_state(records: list[ForwardRecord]) -> dict:
    """Concurrency in the memory-bound steady state of a run (see the module docstring)."""
    limits = [r.admission_limit for r in records]
    out = {
        "measured": False,
        "reason": None,
        "first_memory_bound_forward": None,
        "start_forward": None,
        "end_forward": None,
        "forwards": 0,
        "memory_bound_forwards": 0,
        "memory_bound_share": None,
        "mean_concurrent_requests": None,
        "peak_concurrent_requests": None,
        "pages_per_request": None,
        "mean_waiting_requests": None,
    }
    if "memory" not in limits:
        out["reason"] = "memory never refused a waiting request"
        return out
    first = limits.index("memory")
    out["first_memory_bound_forward"] = first
    filled = records[first].resident
    start = next((i for i in range(first + 1, len(records)) if not (records[i].resident & filled)), None)
    waiting = [i for i, r in enumerate(records) if r.waiting_requests > 0]
    end = waiting[-1] if waiting else None
    if start is None or end is None or end < start:
        out["reason"] = "the queue ran dry before every request of the fill had left"
        return out
    window = records[start : end + 1]
    bound = [r for r in window if r.admission_limit == "memory"]
    out.update(
        start_forward=start,
        end_forward=end,
        forwards=len(window),
        memory_bound_forwards=len(bound),
        memory_bound_share=len(bound) / len(window),
        mean_waiting_requests=statistics.fmean(r.waiting_requests for r in window),
    )
    if not bound:
        out["reason"] = "no memory-bound forward in the steady state"
        return out
    out.update(
        measured=True,
        mean_concurrent_requests=statistics.fmean(r.resident_requests for r in bound),
        peak_concurrent_requests=max(r.resident_requests for r in bound),
        pages_per_request=sum(r.pages_in_use for r in bound) / sum(r.resident_requests for r in bound),
    )
    return out
