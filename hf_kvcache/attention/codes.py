"""Attention straight from a layer's quantized codes: the bridge calls `attend` instead of SDPA for a layer whose
last update handed it code segments (hf_kvcache.layers.codes_read says when and how)."""

from __future__ import annotations

import math

import torch

from ..common.rotation import rotate
from ..kernels import blockwise_attention, cpu_blockwise
from ..layers.codes_read import DEFAULT_BLOCK, native_decode, stop_reading_codes


def block_size(layer, segments) -> int:
    """The layer's `attention_block` (checked against the segments' token alignment), else DEFAULT_BLOCK rounded
    up to it."""
    align = math.lcm(*(s.token_alignment for s in segments))
    block = getattr(layer, "attention_block", None)
    if block is None:
        return -(-DEFAULT_BLOCK // align) * align
    if block % align:
        raise ValueError(
            f"`attention_block` must be a multiple of {align} for this cache (channel-scale blocks / token packing "
            f"cover {align} tokens), got {block}."
        )
    return block


def attend(
    module,
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spec,
    kwargs: dict,
    rotation: torch.Tensor | None = None,
):
    """Attention output [B, q, Hq, Dv] (and None for the weights, as transformers' attention functions return) of
    `query` over the segments the layer's last update recorded; None when that update had nothing stored (the first
    prefill: the caller attends to the new tokens as usual). `spec`: the layer's `attention_validity()` for that
    update. `rotation`: the layer's key rotation when the query is not rotated yet (the native kernel rotates it
    inside its call; the other routes first)."""
    read, layer.codes_read = layer.codes_read, None  # drop the views: they may hold buffers a write replaced
    if read is None or key is not read.key or value is not read.value:
        first_prefill = read is not None and read.keys is None and read.flat is None
        if first_prefill and getattr(layer, "attention", None) != "blockwise":
            # the first prefill (nothing stored yet) shows a model that transforms the cached keys / values before
            # attention (DiffLlama regroups its values): no later step could read them from the codes, so "auto"
            # (and the eviction caches' native route) reads them dequantized from now on; this forward attends to
            # the new tokens as usual
            stop_reading_codes(layer)
            return None
        config = getattr(module, "config", None)
        raise RuntimeError(
            f"{type(module).__name__} (layer {layer.layer_idx}, {type(config).__name__}): this cache attends straight "
            "from its quantized codes (attention='blockwise'), but the model transformed the cached keys / values "
            "before attention (e.g. latent attention expanding its latent), so attention cannot read them from the "
            "codes. Use attention='dequantize' with this model."
        )
    if read.keys is None and read.flat is None:
        return None
    if module.training and kwargs.get("dropout", 0.0):
        raise ValueError("attention='blockwise' has no attention dropout (training); use attention='dequantize'.")
    q = query.shape[2]
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
    needs = layer.needs
    needs_scores = needs.attention
    weight = None
    if needs_scores:
        weight = layer.forward_info.real.to(device=query.device, dtype=torch.float32)
        window = needs.window
        if window is not None and q > window:  # column scores from the last `window` queries only (SnapKV, TOVA)
            weight = torch.cat((torch.zeros_like(weight[:, : q - window]), weight[:, q - window :]), 1)
    if not needs_scores and q == 1 and query.device.type == "cpu" and native_decode():
        # an eager CPU decode step: the native kernel straight away (the layer's own segments, consistent by
        # construction: blockwise_attention's checks and backend choice cost ~30 us a layer for nothing here)
        if getattr(layer, "attention_block", None) is not None:
            block_size(
                layer, [s for segments in read.segments() for s in segments]
            )  # (a setting the native kernel does not use, checked alike)
        valid, sinks = None if spec is None else spec[0], getattr(module, "sinks", None)
        if read.flat is not None:  # the layer's kept view of its store (codes_read.KernelView)
            result = cpu_blockwise.attend_flat(
                query, *read.flat, valid, float(scaling), 0, softcap or None, sinks, query_rotation=rotation
            )
        else:
            n = sum(s.length for s in read.keys)
            result = cpu_blockwise.cpu_blockwise_attention(
                query,
                read.keys,
                read.values,
                n,
                valid,
                float(scaling),
                0,
                softcap or None,
                sinks,
                False,
                query_rotation=rotation,
            )
        return result.transpose(1, 2).contiguous(), None
    if rotation is not None:
        query = rotate(query, rotation)
    keys, values = read.segments()
    result = blockwise_attention(
        query,
        keys,
        values,
        None if spec is None else spec[0],
        float(scaling),
        block=block_size(layer, keys + values),
        causal_tail=q if q > 1 else 0,
        softcap=softcap or None,
        sinks=getattr(module, "sinks", None),
        return_column_scores=needs_scores,
        query_weight=weight,
    )
    if needs_scores:
        result, scores = result
        layer.policy.observe(layer.view, scores)
    return result.transpose(1, 2).contiguous(), None
