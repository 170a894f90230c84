"""transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve`), as
hf_kvcache.paged uses it. It has no public extension point for the page format, so quantized pages rely on:

1. `continuous_api.ContinuousBatchingManager._create_batch_processor` builds the cache by calling the module-level
   name `continuous_api.PagedAttentionCache` (the `paged_cache` patch points it at our subclass).
2. `cache.PagedAttentionCache.__init__(config, continuous_batching_config, device, distributed_helper, dtype,
   model_supports_logits_to_keep)` builds one allocator per attention type from the module-level dict
   `cache.ATTN_TYPE_TO_ALLOCATOR` ("full_attention", "sliding_attention") and sizes sectors from
   `allocator.bytes_per_block`; `_infer_max_decode_fast_path_length` reads `supports_block_table`;
   `update(key_states, value_states, layer_idx, kwargs)`.
3. The allocators (`cache_allocators.FullAttentionCacheAllocator` / `SlidingAttentionCacheAllocator`): `__init__`
   calls `self.get_bytes_per_page(heads, head_dim, dtype, page_size)`; `register_cache_tensor(bytes_per_sector,
   non_trash_bytes, cache_tensor, pool)` ends with `_after_cache_tensor_init(...)`; `rows_per_token == 2`;
   `update(key_states, value_states, layer_idx, read_index, write_index)`; `sentinel_index` marks the new tokens of
   a sliding read; `_copy_view` is the raw byte tensor viewed per block.
4. Something calls `cache.update(key_states, value_states, layer_idx, kwargs=...)` on the paged cache with the
   batch's `read_index` / `write_index` / `cu_seq_lens_*` in `kwargs`: the attention functions
   (`integrations.sdpa_attention` & co.) up to 5.23, each model's attention forward from 5.24.
5. Attention from the pages' codes (hf_kvcache.paged.codes_attention): the model's attention forward calls
   `cache.update(..., kwargs=kwargs)` and then the `AttentionInterface` function of `config._attn_implementation`
   ("sdpa" or "paged|eager" in continuous batching) with the same `**kwargs`, so what update puts in `kwargs` reaches
   the attention function (the `codes_attention` patches wrap those two names; an unmarked call goes to
   transformers').
6. The scheduler as the serving benchmark reads it (hf_kvcache.evaluation.agreement): the manager's `batch_processor`
   with `inputs_and_outputs.requests_in_batch` (`.state.request_id`, `.has_new_token`, `.query_length`,
   `state.initial_tokens`, `state._true_initial_tokens`, `state.generated_len()`), `scheduler.waiting_requests`,
   `scheduler.max_requests_per_batch`, `max_batch_tokens`, and the allocators' `block_table`.
7. Prompt eviction (hf_kvcache.paged.eviction): `ContinuousBatchProcessor._generation_step(model)` runs one forward
   between `prepare_next_batch` (which fills `inputs_and_outputs.position_ids` from each request's
   `state.position_offset` and lists `requests_in_batch`) and `update_batch`; `position_offset` is the request's
   length in the cache (allocation via `current_len()`, read / write indices, `seqlen_k`) as well as the position of
   its next token; an allocator's `get_read_indices(request_id, 0, n)` gives its first n rows, its `block_table`,
   `ledger.release` and `pool.free_blocks` give pages back; `_kv_token_views` are transformers' rows per layer.
8. One request's fault (hf_kvcache.paged.request_faults): the generation loop calls `_generation_step(model)`, then
   `update_batch()`; `ContinuousBatchProcessor._handle_request_error(error, state)` delivers a failure to the
   request's client and `scheduler.finish_request(request_id)` frees its blocks (what transformers itself does for
   a request it cannot add).
"""

from __future__ import annotations

import contextlib
import threading

from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache_allocators import (
    CacheAllocator,
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

from .cache_argument import CACHE_ARG
from .contracts import contract, parameters, require, source

USED_BY = "quantized pages (kv_cache_dtype / enable_paged / serve-bench)"
BUILD = "continuous_api.PagedAttentionCache (cache construction)"
CACHE_INIT = "PagedAttentionCache.__init__ / ATTN_TYPE_TO_ALLOCATOR"
ALLOCATORS = "cache_allocators.FullAttentionCacheAllocator / SlidingAttentionCacheAllocator"
UPDATE = "paged cache.update(..., kwargs=...) caller"
SCHEDULER = "ContinuousBatchingManager.batch_processor (scheduler state)"
REQUEST_FAULTS = "ContinuousBatchProcessor._handle_request_error / scheduler.finish_request / update_batch"
CODES_ATTENTION = "attention forward: cache.update(kwargs=kwargs), then attention_interface(**kwargs)"
EVICTION = "ContinuousBatchProcessor._generation_step / position_offset as the cache length"
#: the attention implementations continuous batching runs with on the index path (flash ones read a block table)
BATCH_ATTENTION = ("sdpa", "paged|eager")
#: set on hf_kvcache.paged.codes_attention's wrapper of those (the `codes_attention` patches)
BATCH_ATTENTION_MARK = "_hf_kvcache_batch_attention"
QUANTIZED_PAGES = (BUILD, CACHE_INIT, ALLOCATORS, UPDATE)

PagedAttentionCache = cb_cache.PagedAttentionCache


@contract(
    BUILD,
    "ContinuousBatchingManager._create_batch_processor calls the module-level name "
    "continuous_api.PagedAttentionCache(...)",
    USED_BY,
)
def _check_build() -> str | None:
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    if not hasattr(continuous_api, "PagedAttentionCache") or manager is None:
        return "continuous_api no longer has PagedAttentionCache / ContinuousBatchingManager"
    if "PagedAttentionCache(" not in source(getattr(manager, "_create_batch_processor", None)):
        return "_create_batch_processor no longer calls PagedAttentionCache(...)"
    return None


@contract(
    CACHE_INIT,
    "PagedAttentionCache(config, continuous_batching_config, device, distributed_helper, dtype, "
    "model_supports_logits_to_keep) builds its allocators from ATTN_TYPE_TO_ALLOCATOR[...] and sizes sectors "
    "from bytes_per_block; update(key_states, value_states, layer_idx, kwargs)",
    USED_BY,
)
def _check_cache_init() -> str | None:
    cls = cb_cache.PagedAttentionCache
    expected = [
        "self",
        "config",
        "continuous_batching_config",
        "device",
        "distributed_helper",
        "dtype",
        "model_supports_logits_to_keep",
    ]
    if parameters(cls.__init__) != expected:
        return f"__init__ takes {parameters(cls.__init__)}, expected {expected}"
    mapping = getattr(cb_cache, "ATTN_TYPE_TO_ALLOCATOR", None)
    if not isinstance(mapping, dict) or set(mapping) != {"full_attention", "sliding_attention"}:
        return f"ATTN_TYPE_TO_ALLOCATOR is {mapping!r}, expected a dict for full / sliding attention"
    text = source(cls.__init__)
    if "ATTN_TYPE_TO_ALLOCATOR[" not in text or "bytes_per_block" not in text:
        return "__init__ no longer builds allocators from ATTN_TYPE_TO_ALLOCATOR[...]"
    if "supports_block_table" not in source(cls._infer_max_decode_fast_path_length):
        return "_infer_max_decode_fast_path_length no longer reads supports_block_table"
    if parameters(cls.update) != ["self", "key_states", "value_states", "layer_idx", "kwargs"]:
        return f"update takes {parameters(cls.update)}"
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    helper = parameters(DistributedHelper.__init__)
    if helper[:3] != ["self", "device_mesh", "cpu_group_timeout"]:
        return f"DistributedHelper.__init__ takes {helper}, expected (device_mesh, cpu_group_timeout, ...)"
    return None


@contract(
    ALLOCATORS,
    "allocators built with (index, config, num_key_value_heads, cache_dtype, page_size, "
    "layer_indices, allow_block_sharing), sized by get_bytes_per_page, rows of keys then values per page "
    "(rows_per_token == 2), register_cache_tensor / _after_cache_tensor_init / sentinel_index / _copy_view",
    USED_BY,
)
def _check_allocators() -> str | None:
    init = [
        "self",
        "index",
        "config",
        "num_key_value_heads",
        "cache_dtype",
        "page_size",
        "layer_indices",
        "allow_block_sharing",
    ]
    for cls in (FullAttentionCacheAllocator, SlidingAttentionCacheAllocator):
        if parameters(cls.__init__) != init:
            return f"{cls.__name__}.__init__ takes {parameters(cls.__init__)}, expected {init}"
        if parameters(cls.update) != ["self", "key_states", "value_states", "layer_idx", "read_index", "write_index"]:
            return f"{cls.__name__}.update takes {parameters(cls.update)}"
        if getattr(cls, "rows_per_token", None) != 2:
            return f"{cls.__name__}.rows_per_token is no longer 2 (a page is no longer key rows then value rows)"
    if "self.get_bytes_per_page(" not in source(FullAttentionCacheAllocator.__init__):
        return "FullAttentionCacheAllocator.__init__ no longer sizes pages with self.get_bytes_per_page(...)"
    register = parameters(FullAttentionCacheAllocator.register_cache_tensor)
    if register != ["self", "bytes_per_sector", "non_trash_bytes", "cache_tensor", "pool"]:
        return f"register_cache_tensor takes {register}"
    for attr in ("_after_cache_tensor_init", "get_read_indices", "get_write_indices", "free_blocks"):
        if not hasattr(CacheAllocator, attr) and not hasattr(FullAttentionCacheAllocator, attr):
            return f"CacheAllocator.{attr} is missing"
    if "sentinel_index" not in source(CacheAllocator._after_cache_tensor_init):
        return "the sliding read no longer marks new tokens with sentinel_index"
    if "_copy_view" not in source(FullAttentionCacheAllocator.register_cache_tensor):
        return "block copies no longer use the raw byte view _copy_view"
    return None


def update_caller() -> str | None:
    """Who calls the paged cache's update on this version: 'attention functions' (<= 5.23) or 'model attention'
    (>= 5.24); None when neither does."""
    from transformers.integrations import sdpa_attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    if "cache.update(" in source(sdpa_attention.sdpa_attention_forward):
        return "attention functions"
    text = source(LlamaAttention.forward)
    if f"{CACHE_ARG}.update(" in text and "kwargs=kwargs" in text:
        return "model attention"
    return None


@contract(
    UPDATE,
    "the paged cache's update(key_states, value_states, layer_idx, kwargs=...) is called with the "
    "batch's read/write indices in kwargs: by the attention functions up to 5.23, by each model's attention "
    "forward from 5.24",
    USED_BY,
)
def _check_update_caller() -> str | None:
    caller = update_caller()
    if caller is None:
        return (
            "neither sdpa_attention_forward nor LlamaAttention.forward calls cache.update(..., kwargs=kwargs) "
            "on the paged cache"
        )
    if caller == "attention functions":
        from transformers.integrations import eager_paged, flash_attention

        for module, fn in (
            (flash_attention, "flash_attention_forward"),
            (eager_paged, "eager_paged_attention_forward"),
        ):
            if "cache.update(" not in source(getattr(module, fn, None)):
                return f"{module.__name__}.{fn} no longer calls cache.update(...) on the paged cache"
    return None


@contract(
    SCHEDULER,
    "manager.batch_processor has inputs_and_outputs.requests_in_batch (state.request_id, "
    "has_new_token, query_length), scheduler.active_requests / waiting_requests / max_requests_per_batch, "
    "max_batch_tokens; RequestState has initial_tokens, _true_initial_tokens, generated_len()",
    "serve-bench (the scheduler trace), hf-kvcache serve (GET /v1/kv_cache)",
)
def _check_scheduler() -> str | None:
    from transformers.generation.continuous_batching.requests import RequestState

    fields = getattr(RequestState, "__dataclass_fields__", {})
    missing = [f for f in ("request_id", "initial_tokens", "_true_initial_tokens") if f not in fields]
    if missing or not hasattr(RequestState, "generated_len"):
        return f"RequestState lacks {missing or ['generated_len']}"
    from transformers.generation.continuous_batching.scheduler import Scheduler

    text = source(Scheduler)
    if "self.active_requests" not in text or "self.waiting_requests" not in text:
        return "Scheduler no longer keeps active_requests / waiting_requests"
    return None


@contract(
    CODES_ATTENTION,
    "from 5.24, each model's attention forward calls cache.update(..., kwargs=kwargs), then the AttentionInterface "
    "function with **kwargs (the dict update filled); AttentionInterface has 'sdpa' and 'paged|eager' (up to 5.23 "
    "the attention functions update the cache themselves, and quantized pages take the gather path)",
    "quantized pages' attention from the codes (hf_kvcache.paged.codes_attention)",
)
def _check_codes_attention() -> str | None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaAttention

    caller = update_caller()
    if caller == "attention functions":  # (<= 5.23: quantized pages take the gather path there; nothing relied on)
        return None
    if caller != "model attention":
        return "the paged cache's update is not called by the model's attention forward"
    text = source(LlamaAttention.forward)
    if "attention_interface(" not in text or "**kwargs" not in text.split("attention_interface(", 1)[1]:
        return "LlamaAttention.forward no longer passes **kwargs to the attention interface"
    missing = [name for name in BATCH_ATTENTION if name not in ALL_ATTENTION_FUNCTIONS]
    return f"AttentionInterface lacks {missing}" if missing else None


@contract(
    EVICTION,
    "ContinuousBatchProcessor._generation_step(model) runs the forward after prepare_next_batch filled "
    "inputs_and_outputs.position_ids from state.position_offset (also the request's cache length: current_len(), "
    "read / write indices, allocation); allocators have get_read_indices, block_table, ledger.release, "
    "pool.free_blocks and _kv_token_views",
    "prompt eviction in continuous batching (kv_compress)",
)
def _check_eviction() -> str | None:
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.requests import RequestState

    step = parameters(continuous_api.ContinuousBatchProcessor._generation_step)
    if step != ["self", "model"]:
        return f"ContinuousBatchProcessor._generation_step takes {step}, expected (model)"
    prepare = source(ContinuousBatchingIOs.prepare_batch_tensors)
    for needle in (
        "past_length = state.position_offset",
        "position_ids.extend(range(past_length, past_length + query_length))",
        "self.requests_in_batch.append(future_state)",
        "extend_read_and_write_indices(",
    ):
        if needle not in prepare:
            return f"ContinuousBatchingIOs.prepare_batch_tensors no longer contains `{needle}`"
    if "position_ids=self.position_ids[" not in source(ContinuousBatchingIOs.get_model_kwargs):
        return "ContinuousBatchingIOs.get_model_kwargs no longer reads the static position_ids"
    if "return self.position_offset" not in source(RequestState.current_len):
        return "RequestState.current_len() is no longer position_offset"
    if "state.current_len()" not in source(cb_cache.PagedAttentionCache.can_store_request_tokens):
        return "PagedAttentionCache.can_store_request_tokens no longer allocates from state.current_len()"
    if "self.block_table" not in source(FullAttentionCacheAllocator.get_read_indices):
        return "FullAttentionCacheAllocator.get_read_indices no longer reads block_table"
    ledger = getattr(cache_allocator, "BlockLedger", None)
    if not hasattr(ledger, "release") or "self.ledger.release(" not in source(CacheAllocator.free_blocks):
        return "CacheAllocator.free_blocks no longer releases blocks through ledger.release"
    if "self._kv_token_views" not in source(FullAttentionCacheAllocator.register_cache_tensor):
        return "FullAttentionCacheAllocator no longer keeps _kv_token_views"
    return None


@contract(
    REQUEST_FAULTS,
    "the generation loop calls _generation_step(model) then update_batch(); "
    "ContinuousBatchProcessor._handle_request_error(error, state) delivers a failed request's error to its client; "
    "scheduler.finish_request(request_id) frees its blocks",
    "one request's fault is one request's error (hf_kvcache.paged.request_faults)",
)
def _check_request_faults() -> str | None:
    processor_class = continuous_api.ContinuousBatchProcessor
    if not all(hasattr(processor_class, name) for name in ("_handle_request_error", "update_batch")):
        return "ContinuousBatchProcessor no longer has _handle_request_error and update_batch"
    handle = parameters(processor_class._handle_request_error)
    if handle != ["self", "error", "state"]:
        return f"ContinuousBatchProcessor._handle_request_error takes {handle}, expected (error, state)"
    if "fail_and_deliver(" not in source(processor_class._handle_request_error):
        return "ContinuousBatchProcessor._handle_request_error no longer delivers the failure (fail_and_deliver)"
    if parameters(processor_class.update_batch) != ["self"]:
        return "ContinuousBatchProcessor.update_batch() changed its parameters"
    from transformers.generation.continuous_batching.scheduler import Scheduler

    if "free_blocks(request_id)" not in source(getattr(Scheduler, "finish_request", None)):
        return "Scheduler.finish_request(request_id) no longer frees the request's blocks"
    body = source(continuous_api.ContinuousBatchingManager._generation_loop_body)
    step, update = body.find("self._generation_step()"), body.find("batch_processor.update_batch()")
    if step < 0 or update < step:
        return "the generation loop no longer calls _generation_step() and then update_batch()"
    return None


def fail_request(processor, state, error: Exception) -> None:
    """Deliver `error` to the client of the request of `state` (its tokens so far go with it) and free its pages; the
    other requests go on."""
    require(REQUEST_FAULTS)
    processor._handle_request_error(error, state)
    processor.scheduler.finish_request(state.request_id)
    if hasattr(processor.scheduler, "block_new_requests"):  # (as update_batch does when a request finishes: pages
        processor.scheduler.block_new_requests = False  # came back, so a scheduler that offloaded admits again)


def attention_takes_cache_rows(config) -> str | None:
    """Why the attention of the model of `config` may do more with the cache's keys and values than hand them to the
    attention function (None: every attention forward of its modeling file that calls `cache.update` passes the
    returned `key_states, value_states` straight on, e.g. Llama's). Read from the source: a forward that transforms
    them (DiffLlama splits the values), keeps them for other layers (Gemma 3n shares them) or attends by other means
    cannot take attention from the codes, which never materialises those rows."""
    import importlib
    import re

    name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(name)
    except ImportError:
        return f"no modeling file {name} to check"
    update = f"{CACHE_ARG}.update("
    call = re.compile(r"attention_interface\(\s*self,\s*query_states,\s*key_states,\s*value_states,")
    found = False
    for cls in vars(module).values():
        text = source(getattr(cls, "forward", None)) if isinstance(cls, type) else ""
        if update not in text:
            continue
        found = True
        after = text.split(update, 1)[1].split("\n", 1)[1]
        between = after.split("attention_interface(", 1)[0]
        if re.search(r"\b(key|value)_states\b", between) or not call.search(after):
            return f"{cls.__name__}.forward does more with the cache's keys and values than pass them to attention"
    return None if found else f"no attention forward of {module.__name__} calls {update}...)"


def batch_attention_wrapped(attn_implementation: str) -> bool:
    """Whether the AttentionInterface function registered as `attn_implementation` is our batch attention wrapper
    (marked BATCH_ATTENTION_MARK; not, e.g., a function someone registered over it since)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        return False
    return getattr(ALL_ATTENTION_FUNCTIONS[attn_implementation], BATCH_ATTENTION_MARK, False)


# -- what hf_kvcache.paged builds on ------------------------------------------------------------------------------

_BUILD_LOCK = threading.Lock()


@contextlib.contextmanager
def allocator_factories(factories: dict):
    """transformers builds a paged cache's allocators from the module-level ATTN_TYPE_TO_ALLOCATOR: `factories`
    stand in while a cache is built in this block (under a lock; the mapping is restored even on error)."""
    with _BUILD_LOCK:
        saved = dict(cb_cache.ATTN_TYPE_TO_ALLOCATOR)
        cb_cache.ATTN_TYPE_TO_ALLOCATOR.update(factories)
        try:
            yield
        finally:
            cb_cache.ATTN_TYPE_TO_ALLOCATOR.clear()
            cb_cache.ATTN_TYPE_TO_ALLOCATOR.update(saved)


def cb_config_of(generation_config, continuous_batching_config) -> ContinuousBatchingConfig:
    """The continuous-batching config a run uses, as transformers picks it: the argument, else the generation
    config's (deprecated) field, else the defaults."""
    if continuous_batching_config is not None:
        return continuous_batching_config
    config = getattr(generation_config, "continuous_batching_config", None)
    return config if isinstance(config, ContinuousBatchingConfig) else ContinuousBatchingConfig()


def request_step(state) -> int:
    """Index of the generated token this forward predicts. A request evicted without CPU offloading restarts with
    its generated tokens appended to its prompt (`_true_initial_tokens` keeps the original prompt length)."""
    prompt = state._true_initial_tokens or len(state.initial_tokens)
    return len(state.initial_tokens) + state.generated_len() - prompt


def batch_processor(manager):
    """The manager's batch processor (None before it started), after checking the scheduler contract."""
    require(SCHEDULER)
    return getattr(manager, "batch_processor", None)


def requests_in_batch(processor) -> list:
    return processor.inputs_and_outputs.requests_in_batch


def scheduler_state(processor) -> tuple[int, int, int]:
    """(waiting requests, the per-batch request limit, the per-forward token budget)."""
    scheduler = processor.scheduler
    return len(scheduler.waiting_requests), scheduler.max_requests_per_batch, processor.max_batch_tokens


def pages_in_use(processor) -> tuple[int, int]:
    """(pages held by requests, pages in all) over the cache's allocators. A page is a `page_size`-token block of
    every layer of its allocator; the complete pages a finished request leaves for prefix sharing are free (the pool
    reclaims them on demand). Read while the generation thread runs: the block tables are copied first."""
    held = total = 0
    for allocator in processor.cache.cache_allocators.values():
        for _ in range(10):  # the generation thread may resize the table while it is copied
            try:
                tables = list(allocator.block_table.values())
                break
            except RuntimeError:
                continue
        else:
            raise RuntimeError("the block table kept changing while it was read (10 tries)")
        held += len({block for table in tables for block in table})
        total += allocator.num_blocks
    return held, total


def request_counts(processor) -> tuple[int, int]:
    """(requests holding pages, requests waiting) of a running batch processor."""
    scheduler = processor.scheduler
    return len(scheduler.active_requests), len(scheduler.waiting_requests)


def model_dtype_block_bytes(config, dtype, page_size: int) -> int:
    """Bytes of one of transformers' `num_blocks` blocks: `page_size` tokens of keys and values for every layer in
    `dtype` (PagedAttentionCache.__init__'s `bytes_per_block`, which turns num_blocks into bytes)."""
    return config.num_hidden_layers * FullAttentionCacheAllocator.get_bytes_per_page(
        find_num_key_value_heads(config), find_head_dim(config), dtype, page_size
    )


def cache_on_meta(cache_class, config, continuous_batching_config, dtype):
    """`cache_class` (a PagedAttentionCache) built on the meta device, so no memory is taken: its page geometry and
    capacity, as a run with this config would have them (transformers sizes `num_blocks` without touching memory;
    an unset `max_memory_percent` counts as 1.0 here)."""
    import copy

    import torch
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    cb_config = copy.deepcopy(continuous_batching_config)
    if cb_config.max_memory_percent is None:
        cb_config.max_memory_percent = 1.0
    return cache_class(config, cb_config, torch.device("meta"), DistributedHelper(None, None), dtype)


__all__ = [
    "CacheAllocator",
    "ContinuousBatchingConfig",
    "FullAttentionCacheAllocator",
    "PagedAttentionCache",
    "BATCH_ATTENTION",
    "BATCH_ATTENTION_MARK",
    "CODES_ATTENTION",
    "EVICTION",
    "QUANTIZED_PAGES",
    "REQUEST_FAULTS",
    "SlidingAttentionCacheAllocator",
    "allocator_factories",
    "attention_takes_cache_rows",
    "batch_attention_wrapped",
    "batch_processor",
    "cache_on_meta",
    "cb_config_of",
    "fail_request",
    "find_head_dim",
    "model_dtype_block_bytes",
    "pages_in_use",
    "request_counts",
    "request_step",
    "requests_in_batch",
    "scheduler_state",
    "update_caller",
]
