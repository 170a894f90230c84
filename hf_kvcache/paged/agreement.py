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
one `ForwardRecord` per forward (hf_kvcache.paged.concurrency): the resident requests and the pages they hold,
the requests still waiting, the query tokens of the batch and the limit that stopped admission at that forward.

Internals relied on (transformers 5.23, see hf_kvcache.paged.internals for the cache ones): the manager returned
by `model.init_continuous_batching` (which `generate_batch` calls) has `batch_processor.inputs_and_outputs.
requests_in_batch` (FutureRequestState: `.state.request_id`, `.state.generated_len()`, `.state.initial_tokens`,
`.state._true_initial_tokens`, `.has_new_token`, `.query_length`) for the batch being computed, and the model is
called with `logits_to_keep` (rows = those requests) or `logits_indices`; `batch_processor.scheduler.
waiting_requests` holds the requests not admitted yet and `.max_requests_per_batch` its per-batch request limit;
`batch_processor.max_batch_tokens` is the token budget of a forward (transformers' FIFO scheduler admits waiting
requests, after the decoding ones, until that budget, the request limit or the cache runs out: its safety margin
or a failed page allocation).
"""

from __future__ import annotations

import contextlib

import torch

from .concurrency import ForwardRecord, admission_limit


def _step(state) -> int:
    """Index of the generated token this forward predicts. A request evicted without CPU offloading restarts with
    its generated tokens appended to its prompt (`create_equivalent_initial_request`, which keeps the original
    prompt length in `_true_initial_tokens`), so count from the original prompt."""
    prompt = state._true_initial_tokens or len(state.initial_tokens)
    return len(state.initial_tokens) + state.generated_len() - prompt


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

    def _note_cache(self, cache) -> None:
        allocator = next(iter(cache.cache_allocators.values()))
        self.resident.append(len(allocator.block_table))
        total = cache.num_sectors * cache.bytes_per_sector
        self.bytes_in_use.append(int(total - cache.compute_free_capacity(relative=False)))
        if not self.cache_facts:
            self.cache_facts = {
                "cache_class": type(cache).__name__,
                "kv_bytes": int(total),
                "num_blocks": int(cache.num_blocks),
                "page_size": int(allocator.tokens_per_page),
                "bytes_per_token_per_layer": allocator.bytes_per_page // allocator.tokens_per_page,
            }

    def _note_step(self, processor, batch) -> None:
        allocator = next(iter(processor.cache.cache_allocators.values()))
        scheduler = processor.scheduler
        waiting = len(scheduler.waiting_requests)
        tokens = sum(f.query_length for f in batch)
        self.steps.append(ForwardRecord(
            resident=frozenset(allocator.block_table),
            pages_in_use=sum(len(blocks) for blocks in allocator.block_table.values()),
            waiting_requests=waiting, batch_requests=len(batch), batch_tokens=tokens,
            admission_limit=admission_limit(waiting, tokens, processor.max_batch_tokens, len(batch),
                                            scheduler.max_requests_per_batch),
        ))

    def hook(self, module, args, kwargs, output):
        if self.manager is None or self.manager.batch_processor is None:
            raise RuntimeError("record_logits: the model ran outside a continuous-batching manager it could see")
        processor = self.manager.batch_processor
        batch = processor.inputs_and_outputs.requests_in_batch
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
            step = _step(state)
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
