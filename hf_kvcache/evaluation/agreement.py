"""Teacher-forced next-token distributions of a continuous-batching run, per request, on the same positions, and
what the cache held at each forward.

    with record_logits(model, force=reference_tokens) as rec:     # force: {request_id: {step: token}} or None
        model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=cb)
    rows = rec.logprobs()          # {request_id: float32 [generated tokens, vocab]}, row g predicts token g

`generate_batch` only returns the sampled tokens, so a forward hook on the model reads the logits of each batch
and maps its rows to requests the way transformers does (the batch's requests that produce a token, in order).
With `force`, the hook then replaces each row by one that makes greedy sampling pick the reference token: the run
is teacher-forced, every request sees the same tokens as the reference run, and KL / top-1 compare the same
positions (hf_kvcache.evaluation.divergence.divergence_metrics). Unforced rows are recorded as sampled.
At every forward the recorder also notes the requests holding pages (`resident`: the full-attention allocator's
block tables), the requests in the batch (`batch_sizes`), the KV bytes in use (`bytes_in_use`) and, in `steps`,
one `ForwardRecord` per forward (hf_kvcache.evaluation.concurrency): the resident requests and the pages they hold,
the requests still waiting, the query tokens of the batch and the limit that stopped admission at that forward.

The scheduler's state is read through hf_kvcache.integration.continuous_batching (contract 5 there): the batch's
requests in order, the waiting requests, the per-batch request and token limits (transformers' FIFO scheduler
admits waiting requests, after the decoding ones, until the token budget, the request limit or the cache runs out:
its safety margin or a failed page allocation). The model is called with `logits_to_keep` (rows = the requests
that produce a token) or `logits_indices`.
"""

from __future__ import annotations

import contextlib

import torch

from ..integration.continuous_batching import batch_processor, request_step, requests_in_batch, scheduler_state
from .concurrency import ForwardRecord, admission_limit


class LogitsRecorder:
    def __init__(self, force: dict[str, dict[int, int]] | None = None):
        self.force = force or {}
        self.manager = None
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.resident: list[int] = []
        self.batch_sizes: list[int] = []
        self.bytes_in_use: list[int] = []
        self.steps: list[ForwardRecord] = []
        self.cache_facts: dict = {}
        self.eviction_stats = None  # the cache's prompt eviction totals (hf_kvcache.paged.eviction), if it evicts

    def _note_cache(self, cache) -> None:
        allocator = next(iter(cache.cache_allocators.values()))
        self.resident.append(len(allocator.block_table))
        total = cache.num_sectors * cache.bytes_per_sector
        self.bytes_in_use.append(int(total - cache.compute_free_capacity(relative=False)))
        if not self.cache_facts:
            evicting = getattr(cache, "eviction", None)
            self.eviction_stats = None if evicting is None else evicting.stats
            self.cache_facts = {
                "cache_class": type(cache).__name__,
                "kv_bytes": int(total),
                "num_blocks": int(cache.num_blocks),
                "page_size": int(allocator.tokens_per_page),
                "bytes_per_token_per_layer": allocator.bytes_per_page // allocator.tokens_per_page,
            }

    def _note_step(self, processor, batch) -> None:
        allocator = next(iter(processor.cache.cache_allocators.values()))
        waiting, max_requests, max_tokens = scheduler_state(processor)
        tokens = sum(f.query_length for f in batch)
        self.steps.append(
            ForwardRecord(
                resident=frozenset(allocator.block_table),
                pages_in_use=sum(len(blocks) for blocks in allocator.block_table.values()),
                waiting_requests=waiting,
                batch_requests=len(batch),
                batch_tokens=tokens,
                admission_limit=admission_limit(waiting, tokens, max_tokens, len(batch), max_requests),
            )
        )

    def hook(self, module, args, kwargs, output):
        processor = None if self.manager is None else batch_processor(self.manager)
        if processor is None:
            raise RuntimeError("record_logits: the model ran outside a continuous-batching manager it could see")
        batch = requests_in_batch(processor)
        self._note_cache(processor.cache)
        self.batch_sizes.append(len(batch))
        self._note_step(processor, batch)
        requests = [f for f in batch if f.has_new_token]
        logits = output.logits
        if "logits_to_keep" in kwargs and isinstance(kwargs["logits_to_keep"], torch.Tensor):
            positions = list(range(len(requests)))
        else:
            positions = kwargs["logits_indices"][: len(requests)].tolist()
        for future, position in zip(requests, positions):
            state = future.state
            step = request_step(state)
            row = logits[0, position]
            self.rows.setdefault(state.request_id, {})[step] = torch.log_softmax(row.float(), -1).cpu()
            forced = self.force.get(state.request_id, {}).get(step)
            if forced is not None:
                row.fill_(float("-inf"))
                row[forced] = 0.0
        return output

    def logprobs(self) -> dict[str, torch.Tensor]:
        """{request_id: [steps, vocab]} with rows in generation order (steps 0, 1, ... all present)."""
        out = {}
        for request_id, steps in self.rows.items():
            missing = sorted(set(range(len(steps))) - set(steps))
            if missing:
                raise RuntimeError(f"record_logits: request {request_id} has no logits for steps {missing}")
            out[request_id] = torch.stack([steps[i] for i in range(len(steps))])
        return out


@contextlib.contextmanager
def record_logits(model, force: dict[str, dict[int, int]] | None = None):
    """Record (and optionally force) the logits of continuous-batching runs of `model` in this block."""
    recorder = LogitsRecorder(force)
    original = model.init_continuous_batching  # an instance attribute if enable_paged wrapped it

    def init_continuous_batching(*args, **kwargs):
        recorder.manager = original(*args, **kwargs)
        return recorder.manager

    had_instance_attr = "init_continuous_batching" in vars(model)
    model.init_continuous_batching = init_continuous_batching
    handle = model.register_forward_hook(recorder.hook, with_kwargs=True)
    try:
        yield recorder
    finally:
        handle.remove()
        if had_instance_attr:
            model.init_continuous_batching = original
        else:
            del model.init_continuous_batching
