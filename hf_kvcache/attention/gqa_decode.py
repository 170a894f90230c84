"""SDPA for one decode token with grouped-query attention, reading each KV head once.

transformers' `sdpa_attention_forward` packs a single query token's heads by KV group ([B, Hkv, groups, D]: the query
heads that share a KV head become that head's queries) in eager decode, but under torch.compile it repeats keys and
values per query head (`repeat_kv`). For our quantized stores that repeat is where inductor fuses dequantization: the
codes were dequantized once per query head (3x for SmolLM2's 9/3 heads), the largest part of compiled FP8 decode's gap
to StaticCache. This module does the packing in both modes for our layers; the math is the same attention.

Contract: `packed_decode_attention(module, query [B, Hq, 1, D], key/value [B, Hkv, kv, D], mask)` returns
`(output [B, 1, Hq, Dv], None)` as transformers' attention functions do, or None when packing does not apply (one
KV head per query head, several query tokens, a mask that differs per query head, or an attention feature SDPA's
packed call would not reproduce: softcap, position bias, attention sinks, dropout in training) and the caller runs
the model's own attention function.
"""

from __future__ import annotations

import torch

_UNSUPPORTED_KWARGS = ("softcap", "position_bias")


def packed_decode_attention(
    module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, kwargs: dict
):
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or q_heads == kv_heads or q_heads % kv_heads:
        return None
    if any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS) or getattr(module, "sinks", None) is not None:
        return None
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    if dropout:
        return None
    if mask is not None and (mask.shape[1] not in (1, kv_heads) or mask.shape[2] != 1):
        return None  # a mask per query head cannot be shared by a KV group
    packed = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=0.0, scale=kwargs.get("scaling")
    )
    out = out.reshape(out.shape[0], q_heads, 1, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None
