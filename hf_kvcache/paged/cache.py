"""QuantizedPagedAttentionCache: transformers' PagedAttentionCache with quantized pages, and the switch.

transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers serve`) builds its
cache in `ContinuousBatchingManager._create_batch_processor` by calling the name `PagedAttentionCache` of the
module `transformers.generation.continuous_batching.continuous_api`. `install()` (run by `import hf_kvcache`)
points that name at `QuantizedPagedAttentionCache` (the `paged_cache` patch of hf_kvcache.integration.patches), a
subclass which:
- with no `kv_cache_dtype` on the continuous-batching config (or "model"), is exactly transformers' cache;
- otherwise builds the quantized allocators (hf_kvcache.paged.allocators) instead of transformers' ones. The
  sector / block sizes, and so the number of pages for a memory budget, are computed by transformers from our
  page size in bytes: `num_blocks` (or the free memory) is turned into bytes with the model-dtype block size as
  usual, and those bytes then hold 1.9-3.2x as many tokens.

The switch, in transformers' style (a field of the config, or one call on the model):

    import hf_kvcache
    cb = ContinuousBatchingConfig(num_blocks=64); cb.kv_cache_dtype = "fp8_e4m3"
    model.generate_batch(inputs, continuous_batching_config=cb)
    # or
    hf_kvcache.enable_paged(model, kv_dtype="fp8_e4m3")   # every continuous-batching run of this model
    model.generate_batch(inputs)

The transformers internals relied on are listed and checked in hf_kvcache.integration.continuous_batching. Where
one of them changed, asking for quantized pages raises `UnsupportedTransformersError` naming it (never model-dtype
pages in their place).
"""

from __future__ import annotations

import copy
import functools
import logging

import torch

from ..integration import patches
from ..integration.continuous_batching import (
    QUANTIZED_PAGES,
    FullAttentionCacheAllocator,
    PagedAttentionCache,
    allocator_factories,
    attention_takes_cache_rows,
    cb_config_of,
    find_num_key_value_heads,
)
from ..integration.contracts import holds, require
from ..integration.memory_handler import tokens_per_sector_divided
from . import codes_attention, compress_spec, eviction, eviction_checks, request_faults, step
from .allocators import ALLOCATORS, QuantizedFullAttentionCacheAllocator
from .head_pages import HeadPagedAllocator
from .spec import DTYPE_FIELD, OPTIONS_FIELD, PagedKVSpec

logger = logging.getLogger(__name__)

UPSTREAM_CACHE = PagedAttentionCache


class QuantizedPagedAttentionCache(UPSTREAM_CACHE):
    """transformers' PagedAttentionCache whose pages hold FP8 / INT8 / INT4 codes + scales when the
    continuous-batching config has `kv_cache_dtype` (see the module docstring)."""

    def __init__(
        self,
        config,
        continuous_batching_config,
        device,
        distributed_helper,
        dtype=None,
        model_supports_logits_to_keep: bool = False,
    ):
        self.kv_spec = PagedKVSpec.from_cb_config(continuous_batching_config)
        kwargs = dict(
            config=config,
            continuous_batching_config=continuous_batching_config,
            device=device,
            distributed_helper=distributed_helper,
            model_supports_logits_to_keep=model_supports_logits_to_keep,
        )
        if dtype is not None:
            kwargs["dtype"] = dtype
        compress = compress_spec.from_cb_config(continuous_batching_config)  # (validated before the pages are built)
        evicting = getattr(continuous_batching_config, compress_spec.FIELD, None) is not None  # ("none": per request)
        if evicting and compress_spec.layout_of(continuous_batching_config) == "head":
            self._build_head_pages(config, kwargs)
        elif self.kv_spec is None:
            super().__init__(**kwargs)
        else:
            self._build_quantized(config, kwargs)
        self.eviction = None
        if self.kv_spec is not None or evicting:
            self.faults = request_faults.StepFaults() if step.install(required=evicting) else None
        if evicting:
            eviction.install()
            self.eviction = eviction.PagedEviction(self, compress, config, continuous_batching_config)

    def _build_quantized(self, config, kwargs) -> None:
        spec, device = self.kv_spec, kwargs["device"]
        factories = {name: functools.partial(cls, kv_spec=spec) for name, cls in ALLOCATORS.items()}
        require(*QUANTIZED_PAGES)
        with allocator_factories(factories):  # ours stand in for transformers' while this cache is built
            super().__init__(**kwargs)
        # capacity in whole-model blocks of quantized pages (transformers counted model-dtype blocks)
        layers = config.num_hidden_layers
        page_bytes = next(iter(self.cache_allocators.values())).bytes_per_page
        self.num_blocks = (self.num_sectors * self.bytes_per_sector) // (layers * page_bytes)
        self._choose_attention_path(config, torch.device(device))

    def _build_head_pages(self, config, kwargs) -> None:
        """Pages of one (layer, KV head) (hf_kvcache.paged.head_pages), in the model's dtype or quantized by
        `kv_spec`; attention reads them with the paged kernels, one KV head per (head, request) pair."""
        require(*QUANTIZED_PAGES)
        patches.install(patches.HEAD_PAGES)
        factory = functools.partial(HeadPagedAllocator, kv_spec=self.kv_spec)
        heads, helper = find_num_key_value_heads(config), kwargs["distributed_helper"]
        if helper.tp_size > 1 and helper.are_kv_heads_tp_ed():  # (as transformers splits them)
            heads //= helper.tp_size
        streams = config.num_hidden_layers * heads
        with allocator_factories({FullAttentionCacheAllocator.layer_type: factory}), tokens_per_sector_divided(streams):
            super().__init__(**kwargs)
        allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
        if not isinstance(allocator, HeadPagedAllocator) or len(self.cache_allocators) != 1:
            raise ValueError(
                f"`{compress_spec.LAYOUT_FIELD}` 'head' needs a model whose layers all use full attention, got "
                f"{sorted(self.cache_allocators)}."
            )
        # capacity in whole-model blocks (every layer and head of `page_size` tokens), as transformers counts them
        whole = allocator.streams * allocator.bytes_per_page
        self.num_blocks = (self.num_sectors * self.bytes_per_sector) // whole
        self.max_tokens_read = self.num_blocks * allocator.tokens_per_page  # (transformers' counts head pages)
        self.tokens_per_sector = max(1, self.tokens_per_sector // allocator.streams)
        device = torch.device(kwargs["device"])
        fatal = codes_attention.unreadable_pages() or attention_takes_cache_rows(config)
        if fatal is not None and device.type != "meta":  # (attention must read the pages: it has no rows)
            raise ValueError(
                f"`{compress_spec.LAYOUT_FIELD}` 'head' cannot run here: {fatal}; 'token' pages evict with per-token "
                "budgets (`hf-kvcache serve --kv-layout token`)."
            )
        reason = codes_attention.unavailable(device, explicit=True) if device.type != "meta" else "meta"
        if device.type == "cpu" and allocator.flat is not None and reason is None:
            allocator.backend = "native"
        elif device.type == "cuda" and reason is None:
            allocator.backend = "triton"
        else:  # where no kernel runs (no C++ compiler, Triton missing, power-of-two scales)
            logger.info("head pages: attention runs a PyTorch loop over (head, request) pairs (%s)", reason)
            allocator.backend = "torch"
        codes_attention.install()
        self.attention_path = "heads"

    #: prompt eviction (hf_kvcache.paged.eviction) when the continuous-batching config has `kv_compress`, else None
    eviction = None
    #: the requests a step failed (hf_kvcache.paged.request_faults), for quantized pages or `kv_compress`; None:
    #: transformers' handling (every fault fatal to the loop)
    faults = None

    #: "codes" (full-attention layers attend straight from the pages: hf_kvcache.paged.codes_attention) or
    #: "dequantize" (gather and dequantize, then transformers' attention); model-dtype pages: "model"; pages of one
    #: (layer, head): "heads" (hf_kvcache.paged.head_pages)
    attention_path = "model"

    def _choose_attention_path(self, config, device: torch.device) -> None:
        """`kv_cache_quantization.attention`: "dequantize", or the codes where the kernel runs ("auto" falls back to
        "dequantize" with the reason logged; "codes" raises it)."""
        self._page_views: dict[int, tuple] = {}
        self.attention_path = "dequantize"
        if self.kv_spec.attention == "dequantize" or device.type == "meta":
            return
        explicit = self.kv_spec.attention == "codes"
        reason = codes_attention.unavailable(device, explicit) or attention_takes_cache_rows(config)
        full = [a for a in self.cache_allocators.values() if isinstance(a, QuantizedFullAttentionCacheAllocator)]
        if reason is None:
            for allocator in full:
                for layer_idx in allocator.layer_indices:
                    pages = allocator.page_views(layer_idx)
                    flat = codes_attention.native_views(pages) if device.type == "cpu" else None
                    if device.type == "cpu" and flat is None:
                        reason = f"{self.kv_spec.scale_dtype} scales (the kernel would read float32 copies of them)"
                        break
                    self._page_views[layer_idx] = (pages, flat)
        if reason is not None:
            self._page_views = {}
            if self.kv_spec.attention == "codes":
                raise ValueError(
                    f"`{OPTIONS_FIELD}.attention` = 'codes' cannot run here: {reason}. Use 'auto' or 'dequantize'."
                )
            logger.info("quantized pages: attention gathers and dequantizes (%s)", reason)
            return
        codes_attention.install()
        for allocator in full:
            allocator.codes_attention = True
        self.attention_path = "codes"

    def update(self, key_states, value_states, layer_idx, kwargs):
        """transformers' update. Quantized full-attention layers whose attention reads the codes: the allocator only
        writes, and the layer's kwargs get the `PagedCodes` the attention function reads (codes_attention). Else, on
        the index path, first tells the allocator which read positions belong to requests in their first forward
        (see first_forward_masks)."""
        allocator = self.layer_to_allocator[layer_idx]
        if self.eviction is not None:
            self.eviction.layer_kwargs(layer_idx, kwargs)
        if isinstance(allocator, HeadPagedAllocator):  # write only; attention reads each head's pages
            keys, values = super().update(key_states, value_states, layer_idx, kwargs)
            if not codes_attention.active(self.config):
                raise RuntimeError(
                    f"`{compress_spec.LAYOUT_FIELD}` 'head': the model's attention function is not hf_kvcache's batch "
                    "attention wrapper (someone replaced it after `import hf_kvcache`), so it cannot read head pages."
                )
            kwargs[codes_attention.KWARG] = allocator.layer_codes(layer_idx, (keys, values))
            return keys, values
        codes = getattr(allocator, "codes_attention", False) and codes_attention.active(self.config)
        if codes:  # write only; the attention function reads the pages
            allocator.write_only = True
            try:
                keys, values = super().update(key_states, value_states, layer_idx, kwargs)
            finally:
                allocator.write_only = False
            pages, flat = self._page_views[layer_idx]
            fresh_keys, fresh_values = allocator.fresh
            kwargs[codes_attention.KWARG] = codes_attention.PagedCodes(
                returned=(keys, values),
                pages=pages,
                flat=flat,
                fresh_keys=fresh_keys,
                fresh_values=fresh_values,
                read_index=kwargs["read_index"][allocator.index],
                cu_seq_lens_q=kwargs["cu_seq_lens_q"],
                cu_seq_lens_k=kwargs["cu_seq_lens_k"],
                key_rotation=allocator.key_rotation,
                max_length_q=kwargs.get("max_length_q"),
            )
            allocator.fresh = None
            return keys, values
        if self.kv_spec is not None and kwargs.get("block_table") is None and hasattr(allocator, "first_forward"):
            cu_k = kwargs["cu_seq_lens_k"]
            cu_k = cu_k[allocator.layer_type] if isinstance(cu_k, dict) else cu_k
            read_index = kwargs["read_index"][allocator.index]
            allocator.first_forward = first_forward_masks(
                kwargs["cu_seq_lens_q"], cu_k, read_index.shape[0], key_states.shape[-2]
            )
        return super().update(key_states, value_states, layer_idx, kwargs)

    def tokens_capacity(self) -> int:
        """Tokens of one request the pages could hold for every layer (whole-model blocks x page size)."""
        return self.num_blocks * next(iter(self.cache_allocators.values())).tokens_per_page


def first_forward_masks(cu_seq_lens_q, cu_seq_lens_k, num_read: int, num_new: int):
    """Boolean masks over the packed read positions [num_read] and new tokens [num_new] of the requests whose
    query is their whole key range (no past: their first forward). Requests are packed in order in both; positions
    past the last request (padding) are False. Tensor ops only (no host synchronisation)."""
    cu_q, cu_k = cu_seq_lens_q.long(), cu_seq_lens_k.long()
    first = (cu_q[1:] - cu_q[:-1]) == (cu_k[1:] - cu_k[:-1])  # [requests]
    first = torch.cat([first, first.new_zeros(1)])  # index `requests` = padding
    device = first.device
    read_req = torch.searchsorted(cu_k[1:], torch.arange(num_read, device=device), right=True)
    new_req = torch.searchsorted(cu_q[1:], torch.arange(num_new, device=device), right=True)
    return first[read_req], first[new_req]


patches.provide("continuous_api.PagedAttentionCache", lambda original: QuantizedPagedAttentionCache)


def install(strict: bool = True) -> bool:
    """Make transformers' continuous batching build QuantizedPagedAttentionCache (idempotent). If this transformers
    version changed an internal we rely on: raise `UnsupportedTransformersError` naming it (strict), or leave
    transformers untouched and return False (`import hf_kvcache` does that, so the rest of the library still
    imports; a run that then asks for quantized pages raises: see `check_requested`)."""
    if patches.installed(patches.PAGED_CACHE):
        return True
    if not strict and not all(holds(name) for name in QUANTIZED_PAGES):
        return False
    patches.install(patches.PAGED_CACHE)  # (hf_kvcache.integration.patches lists it)
    return True


def requested_spec(model, generation_config=None, continuous_batching_config=None) -> PagedKVSpec | None:
    """The page format a continuous-batching run of `model` asks for (its config's `kv_cache_dtype`, else
    `enable_paged`'s), None for model-dtype pages."""
    cb_config = cb_config_of(
        generation_config if generation_config is not None else model.generation_config, continuous_batching_config
    )
    return PagedKVSpec.from_cb_config(cb_config) or getattr(model, "_hf_kvcache_paged_spec", None)


def check_requested(model, generation_config=None, continuous_batching_config=None) -> None:
    """Before transformers starts a continuous-batching run: a run that asks for quantized pages on a transformers
    whose internals changed raises `UnsupportedTransformersError` instead of silently using model-dtype pages; one
    that asks for prompt eviction the model cannot run raises ValueError naming `kv_compress` (in the caller's
    thread, before any request is queued)."""
    if requested_spec(model, generation_config, continuous_batching_config) is not None:
        install(strict=True)
    cb_config = cb_config_of(
        generation_config if generation_config is not None else model.generation_config, continuous_batching_config
    )
    if getattr(cb_config, compress_spec.FIELD, None) is not None:
        eviction_checks.check_model(
            compress_spec.from_cb_config(cb_config), model.config.get_text_config(), compress_spec.layout_of(cb_config)
        )


def enable_paged(model, kv_dtype: str | None = "fp8_e4m3", **options) -> None:
    """Quantized pages for every continuous-batching run of `model` (`generate_batch`, `init_continuous_batching`,
    `continuous_batching_context_manager`): `kv_dtype` as `kv_cache_dtype`, `options` as `kv_cache_quantization`
    (see hf_kvcache.paged.spec). A config passed to the call that sets `kv_cache_dtype` itself wins.
    `kv_dtype=None` (or "model") turns it off again."""
    spec = PagedKVSpec.from_fields(kv_dtype, options or None)
    install()
    saved = getattr(model, "_hf_kvcache_original_init_cb", None)  # (instance attribute before us, or None)
    if spec is None:
        if saved is not None:
            if saved[0] is None:
                del model.init_continuous_batching  # transformers' method again
            else:
                model.init_continuous_batching = saved[0]
            del model._hf_kvcache_original_init_cb, model._hf_kvcache_paged_spec
        return
    if saved is None:
        saved = (vars(model).get("init_continuous_batching"),)
        model._hf_kvcache_original_init_cb = saved
    original = saved[0] if saved[0] is not None else type(model).init_continuous_batching.__get__(model)

    @functools.wraps(original)
    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        gen = generation_config if generation_config is not None else model.generation_config
        cb_config = cb_config_of(gen, continuous_batching_config)
        if getattr(cb_config, DTYPE_FIELD, None) is None:
            cb_config = copy.deepcopy(cb_config)
            setattr(cb_config, DTYPE_FIELD, spec.kv_dtype)
            setattr(cb_config, OPTIONS_FIELD, {k: v for k, v in spec.to_dict().items() if k != "kv_dtype"})
        return original(
            generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=workload_hints
        )

    model.init_continuous_batching = init_continuous_batching
    model._hf_kvcache_paged_spec = spec
