"""Attention straight from quantized pages: no dequantized copy of the batch's keys and values.

transformers' index path (every non-flash attention, so every CPU run) has the cache's `update` gather the keys and
values each request reads (`read_index`) into one packed tensor and attends every query of the batch to every key of
it under one block-diagonal mask: for quantized pages that is a dequantized copy per layer and step, and attention
that grows with (queries of the batch) x (keys of the batch). Here, for the full-attention layers of quantized pages:
- the allocator's update only writes the new tokens (quantized, in place) and returns empty keys and values; the
  cache puts a `PagedCodes` (the pages' codec views, the new tokens, the batch's indices) into the layer's kwargs;
- the attention function transformers calls next ("sdpa" or "paged|eager", wrapped by `install`) finds it there and
  runs a kernel: on CPU the native one (`kernels.cpu_blockwise.paged_attention`), on CUDA the Triton one
  (`kernels.triton_paged`, with attention="codes" until a GPU run has checked it): request by request, each page's
  codes read where they lie, a request in its first forward attending to its own tokens unquantized (as the
  dequantize path does).

Where no kernel runs (CUDA without attention="codes", no C++ compiler, torch.compile, scales stored as powers of
two, which the kernel reads as float32 copies, a transformers whose attention forward does not pass the update's
kwargs on: `CODES_ATTENTION`, or a model whose attention does more with the cache's keys and values than attend to
them: `attention_takes_cache_rows`, e.g. DiffLlama, Gemma 3n, DeepSeek-V3's MLA), the allocator gathers and
dequantizes as before; `kv_cache_quantization.attention = "dequantize"` asks for that path explicitly (the
benchmarks' comparison row). `QuantizedPagedAttentionCache.attention_path` says which path a cache takes.

The same wrapper hands a layer's queries to prompt eviction when the cache's update asked for them (`OBSERVE_KWARG`:
SnapKV scores the prompt by its last queries), on any page format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..integration import patches
from ..integration.continuous_batching import (
    BATCH_ATTENTION,
    BATCH_ATTENTION_MARK,
    CODES_ATTENTION,
    batch_attention_wrapped,
    update_caller,
)
from ..integration.contracts import holds
from ..kernels import cpu_blockwise, triton_paged
from ..kernels.codes import QuantizedKV
from ..stores.code_views import from_codec

#: the kwargs key under which a layer's PagedCodes travels from the cache's update to the attention function
KWARG = "hf_kvcache_paged_codes"
#: the kwargs key under which prompt eviction (hf_kvcache.paged.eviction) asks a layer's attention function for its
#: queries: a callable (query [1, Hq, total_q, D], scaling) the wrapper calls, then drops from the kwargs
OBSERVE_KWARG = "hf_kvcache_observe_queries"


def page_views(k_codec, v_codec) -> tuple[QuantizedKV, QuantizedKV]:
    """A layer's key and value pages as QuantizedKV views of all their rows (no copy): what the kernels read."""
    return from_codec(k_codec, k_codec.capacity), from_codec(v_codec, v_codec.capacity)


def native_views(pages: tuple[QuantizedKV, QuantizedKV]):
    """The native kernel's flattened (keys, values) views of `page_views`, or None where it would read a converted
    copy (power-of-two scales: float32 copies of every page's scales at every call)."""
    views = [cpu_blockwise.flatten_views([kv]) for kv in pages]
    return None if None in views else tuple(views)


def fresh_views(keys: torch.Tensor, values: torch.Tensor):
    """The native kernel's flattened views of a batch's new tokens [1, Hkv, N, D] in full precision (float32 copies
    where the kernel does not read their dtype as it is)."""
    fresh = tuple(cpu_blockwise.flatten_views([QuantizedKV(x, "none")]) for x in (keys, values))
    if None in fresh:
        fresh = tuple(cpu_blockwise.flatten_views([QuantizedKV(x.float(), "none")]) for x in (keys, values))
    return fresh


def unreadable_pages() -> str | None:
    """Why no attention function can read the pages on this transformers (None: ours can, on any device)."""
    if not holds(CODES_ATTENTION):
        return f"this transformers breaks the contract {CODES_ATTENTION!r}"
    if update_caller() != "model attention":
        return "transformers <= 5.23 updates paged caches inside its attention functions"
    return None


def unavailable(device: torch.device, explicit: bool = False) -> str | None:
    """Why attention from the codes cannot run for pages on `device` (None: it can). CUDA takes the Triton kernel
    only when asked for (`explicit`: attention="codes") until a GPU run has checked it (see docs/serving.md)."""
    reason = unreadable_pages()
    if reason is not None:
        return reason
    if device.type == "cuda":
        if not triton_paged.triton:
            return "Triton is not installed (the CUDA kernel is a Triton kernel)"
        return None if explicit else "the CUDA kernel is used only with attention='codes' until a GPU run checks it"
    if device.type != "cpu":
        return f"pages on {device.type} (kernels exist for CPU and CUDA)"
    return cpu_blockwise.unusable(torch.empty(0))


@dataclass
class PagedCodes:
    """One layer's forward of a quantized-pages batch, as the attention function needs it."""

    returned: tuple  # the (empty) keys and values the cache's update returned: the attention call must pass them
    pages: tuple  # (keys, values) QuantizedKV views of the layer's pages (`page_views`)
    flat: tuple | None  # their `native_views` (CPU), or None
    fresh_keys: torch.Tensor  # [1, Hkv, N, Dk]: the new tokens, rotated as the pages' keys are
    fresh_values: torch.Tensor  # [1, Hkv, N, Dv]
    read_index: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    key_rotation: torch.Tensor | None
    max_length_q: int | None = None  # the most queries of one request (continuous batching's host int)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float | None,
        softcap=None,
        sinks=None,
        split_columns: int = 0,
        backend: str = "auto",
    ) -> torch.Tensor:
        """query [1, Hq, N, Dk] -> the attention output [1, N, Hq, Dv] in the query's dtype (as sdpa's).
        `split_columns`: columns per range of a request's flash-decoding split (native; 0: chosen from the shapes).
        `backend`: "native" (CPU), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto" (by the device)."""
        scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if backend == "auto":
            backend = "native" if query.device.type == "cpu" else "triton"
        if backend == "triton":
            q = query[0].float()
            if self.key_rotation is not None:
                q = q @ self.key_rotation.float()
            max_q = self.max_length_q
            if max_q is None:
                max_q = int((self.cu_seq_lens_q[1:] - self.cu_seq_lens_q[:-1]).max())
            out = triton_paged.triton_paged_attention(
                q,
                *self.pages,
                self.fresh_keys,
                self.fresh_values,
                self.cu_seq_lens_q,
                self.cu_seq_lens_k,
                self.read_index,
                scaling,
                max_q,
                softcap=softcap,
                sinks=sinks,
            )
            return out.transpose(0, 1).unsqueeze(0).to(query.dtype)
        heads, dv = self.fresh_values.shape[1], self.fresh_values.shape[-1]
        fresh = fresh_views(self.fresh_keys, self.fresh_values)
        out = cpu_blockwise.paged_attention(
            query[0],
            self.flat,
            fresh,
            dv,
            heads,
            self.cu_seq_lens_q,
            self.cu_seq_lens_k,
            self.read_index,
            scaling,
            softcap=softcap,
            sinks=sinks,
            split_columns=split_columns,
            query_rotation=self.key_rotation,
        )
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def active(config) -> bool:
    """Whether the attention function the model will call is our wrapper (a forward whose attention function
    someone replaced after `install`, e.g. a profiler's timer around transformers' sdpa, takes the dequantize path)."""
    return batch_attention_wrapped(config._attn_implementation)


def _with_paged_codes(original):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        observe = kwargs.pop(OBSERVE_KWARG, None)
        if observe is not None:  # prompt eviction reads this layer's queries (hf_kvcache.paged.eviction)
            observe(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
        codes = kwargs.get(KWARG)
        if codes is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if key is not codes.returned[0] or value is not codes.returned[1]:
            raise RuntimeError(
                f"{type(module).__name__} changed the keys or values between the cache's update and attention, "
                "which attention from quantized pages' codes cannot follow; set "
                "kv_cache_quantization['attention'] = 'dequantize' for this model."
            )
        return codes.attend(query, scaling, kwargs.get("softcap"), kwargs.get("s_aux")), None

    attention.__doc__ = f"transformers' {getattr(original, '__name__', 'attention')}, or attention from the pages' "
    attention.__doc__ += f"codes when the cache's update left a `{KWARG}` in the kwargs (hf_kvcache.paged)."
    setattr(attention, BATCH_ATTENTION_MARK, True)
    return attention


for _name in BATCH_ATTENTION:  # (applied by `install`, listed in hf_kvcache.integration.patches)
    patches.provide(f"AttentionInterface._global_mapping[{_name!r}]", _with_paged_codes)


def install() -> None:
    """Wrap continuous batching's attention functions (idempotent; see the module docstring): the
    `codes_attention` patches."""
    patches.install(patches.CODES_ATTENTION)
