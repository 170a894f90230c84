"""Attention straight from quantized pages: no dequantized copy of the batch's keys and values.

transformers' index path (every non-flash attention, so every CPU run) has the cache's `update` gather the keys and
values each request reads (`read_index`) into one packed tensor and attends every query of the batch to every key of
it under one block-diagonal mask: for quantized pages that is a dequantized copy per layer and step, and attention
that grows with (queries of the batch) x (keys of the batch). Here, for the full-attention layers of quantized pages:
- the allocator's update only writes the new tokens (quantized, in place) and returns empty keys and values; the
  cache puts a `PagedCodes` (the pages' codec views, the new tokens, the batch's indices) into the layer's kwargs;
- the attention function transformers calls next ("sdpa" or "paged|eager", wrapped by `install`) finds it there and
  runs the native kernel (`kernels.cpu_blockwise.paged_attention`): request by request, each page's codes read
  where they lie, a request in its first forward attending to its own tokens unquantized (as the dequantize path).

Where the kernel cannot run (CUDA tensors, no C++ compiler, torch.compile, scales stored as powers of two, which the
kernel reads as float32 copies, or a transformers whose attention forward does not pass the update's kwargs on:
`CODES_ATTENTION`), the allocator gathers and dequantizes as before; `kv_cache_quantization.attention =
"dequantize"` asks for that path explicitly (the benchmarks' comparison row). `QuantizedPagedAttentionCache
.attention_path` says which path a cache takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..integration.continuous_batching import CODES_ATTENTION, wrap_batch_attention
from ..integration.contracts import holds
from ..kernels import cpu_blockwise
from ..kernels.codes import QuantizedKV
from ..stores.code_views import from_codec

#: the kwargs key under which a layer's PagedCodes travels from the cache's update to the attention function
KWARG = "hf_kvcache_paged_codes"


def page_views(k_codec, v_codec):
    """The kernel's (keys, values) views of a layer's pages (all their rows, no copy), or None where the kernel
    would need a converted copy (power-of-two scales)."""
    views = [cpu_blockwise.flatten_views([from_codec(codec, codec.capacity)]) for codec in (k_codec, v_codec)]
    return None if None in views else tuple(views)


def unavailable(device: torch.device) -> str | None:
    """Why attention from the codes cannot run for pages on `device` (None: it can)."""
    if device.type != "cpu":
        return f"pages on {device.type} (the paged kernel is CPU-only for now; CUDA gathers and dequantizes)"
    if not holds(CODES_ATTENTION):
        return f"this transformers breaks the contract {CODES_ATTENTION!r}"
    return cpu_blockwise.unusable(torch.empty(0))


@dataclass
class PagedCodes:
    """One layer's forward of a quantized-pages batch, as the attention function needs it."""

    pages: tuple  # (keys, values): flattened views of the layer's pages (`page_views`)
    fresh_keys: torch.Tensor  # [1, Hkv, N, Dk]: the new tokens, rotated as the pages' keys are
    fresh_values: torch.Tensor  # [1, Hkv, N, Dv]
    read_index: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    key_rotation: torch.Tensor | None

    def attend(
        self, query: torch.Tensor, scaling: float | None, softcap=None, sinks=None, split_columns: int = 0
    ) -> torch.Tensor:
        """query [1, Hq, N, Dk] -> the attention output [1, N, Hq, Dv] in the query's dtype (as sdpa's).
        `split_columns`: columns per range of a request's flash-decoding split (0: chosen from the shapes)."""
        heads, dv = self.fresh_values.shape[1], self.fresh_values.shape[-1]
        fresh = tuple(
            cpu_blockwise.flatten_views([QuantizedKV(x, "none")]) for x in (self.fresh_keys, self.fresh_values)
        )
        if None in fresh:  # a dtype the kernel does not read as it is
            fresh = tuple(
                cpu_blockwise.flatten_views([QuantizedKV(x.float(), "none")])
                for x in (self.fresh_keys, self.fresh_values)
            )
        out = cpu_blockwise.paged_attention(
            query[0],
            self.pages,
            fresh,
            dv,
            heads,
            self.cu_seq_lens_q,
            self.cu_seq_lens_k,
            self.read_index,
            scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
            softcap=softcap,
            sinks=sinks,
            split_columns=split_columns,
            query_rotation=self.key_rotation,
        )
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _with_paged_codes(original):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        codes = kwargs.get(KWARG)
        if codes is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return codes.attend(query, scaling, kwargs.get("softcap"), kwargs.get("s_aux")), None

    attention.__doc__ = f"transformers' {getattr(original, '__name__', 'attention')}, or attention from the pages' "
    attention.__doc__ += f"codes when the cache's update left a `{KWARG}` in the kwargs (hf_kvcache.paged)."
    return attention


def install() -> None:
    """Wrap continuous batching's attention functions (idempotent; see the module docstring)."""
    wrap_batch_attention(_with_paged_codes)
