"""The attention bridge between transformers and our cache layers.

`Cache.update` sees only keys and values, and transformers' padding mask assumes the cached columns are contiguous
positions. The bridge closes both gaps for a model it is enabled on:
- a forward pre-hook tells our cache, before any layer runs, which new tokens are padding and their position ids;
- an attention function registered with `transformers.AttentionInterface` (`hf_kvcache_sdpa` / `hf_kvcache_eager`)
  wraps the model's own implementation and, for layers that need it, replaces the mask by the layer's own
  validity mask (padding, empty or evicted slots). With any other cache it calls the wrapped function unchanged.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

from ..common.rotation import rotate
from ..integration.attention import (
    BRIDGE_CONTRACTS,
    attention_implementation,
    attention_weights_requested,
    can_set_attention,
    eager_attention_for,
    eager_mask,
    forward_arguments,
    sdpa_attention_forward,
    sdpa_mask,
)
from ..integration.cache_argument import given_cache
from ..integration.contracts import require
from ..layers.forward_info import ForwardAnnounced
from ..layers.layer import CompressedLayer
from .codes import attend
from .gqa_decode import packed_decode_attention
from .scored import scored_attention

logger = logging.getLogger(__name__)

BRIDGE_NAMES = {"sdpa": "hf_kvcache_sdpa", "eager": "hf_kvcache_eager"}
_INNER = ("hf_kvcache_sdpa", "hf_kvcache_eager")


def _bridge_sdpa_mask(*args, **kwargs):
    """transformers' sdpa mask, except that with one of our caches a decode step never reads the padding mask on
    the host to decide whether the mask can be skipped (our layers bring their own validity in decode)."""
    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    if q_length == 1 and active_cache() is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


_MASKS = {"hf_kvcache_sdpa": _bridge_sdpa_mask, "hf_kvcache_eager": eager_mask}
_local = threading.local()


def _active_stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def active_cache():
    """The hf_kvcache cache of the innermost forward running on this thread, if any."""
    stack = _active_stack()
    return stack[-1] if stack else None


def build_validity_mask(validity: torch.Tensor, causal_tail: int, query: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, H or 1, q, kv] from column validity [B, Hm, kv]. The last `causal_tail` columns are the new
    tokens in order (causal among themselves); each new token always sees itself, so no row is empty."""
    _batch, q_heads, q_len, _ = query.shape
    kv = validity.shape[-1]
    mask = validity[:, :, None, :].expand(-1, -1, q_len, -1).clone()
    if causal_tail:
        tail = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril()
        mask[..., kv - q_len :] &= tail
        idx = torch.arange(q_len, device=mask.device)
        mask[..., idx, kv - q_len + idx] = True
    if mask.shape[1] not in (1, q_heads):
        mask = mask.repeat_interleave(q_heads // mask.shape[1], dim=1)
    return mask


def attention_column_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    query_weight: torch.Tensor,
    chunk: int = 256,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    reduce: str = "sum",
    normalize_over: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probability received by each key column, summed over the (weighted) queries: [B, Hq, kv] float32.

    Computed in float32, `chunk` queries at a time so prefill memory stays bounded. `mask` is a boolean (True =
    attend) or additive mask broadcastable to [B, Hq, q, kv]; None means causal with the queries last. As the
    model's own attention does: `softcap` squashes logits (Gemma 2: softcap * tanh(logits / softcap)); `sinks`
    [Hq] are extra logits in each softmax denominator that no key receives (GPT-OSS). `reduce` / `normalize_over`:
    as in hf_kvcache.attention.scored (the largest probability instead of the sum; a softmax restricted to some
    columns)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    keys = key.float().transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, kv]
    total = torch.zeros(batch, q_heads, kv, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, chunk):
        end = min(q_len, start + chunk)
        q = query[:, :, start:end].float().view(batch, kv_heads, groups, end - start, dim)
        logits = (q @ keys).view(batch, q_heads, end - start, kv) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is None:
            rows = torch.arange(start, end, device=query.device)[:, None] + (kv - q_len)
            logits = logits.masked_fill(torch.arange(kv, device=query.device) > rows, float("-inf"))
        else:
            m = mask[:, :, start:end] if mask.shape[2] > 1 else mask
            if m.dtype == torch.bool:
                logits = logits.masked_fill(~m, float("-inf"))
            else:
                logits = logits + m.float()
        if sinks is not None:
            sink = sinks.float().view(1, q_heads, 1, 1).expand(batch, q_heads, end - start, 1)
            probs = torch.softmax(torch.cat((logits, sink), -1), dim=-1)[..., :kv]
        else:
            probs = torch.softmax(logits, dim=-1)
        if normalize_over is not None:
            probs = probs / (probs * normalize_over[:, None, None, :]).sum(-1, keepdim=True).clamp_min(1e-30)
        probs = probs * query_weight[:, None, start:end, None]
        total = total + probs.sum(2) if reduce == "sum" else torch.maximum(total, probs.amax(2))
    return total


def _attend_with_scores(module, layer, query, key, value, spec, kwargs):
    """Attention output [B, q, Hq, Dv] (and None for the weights, as transformers' attention functions return) and
    the policy's column scores from the same pass. `spec` is the layer's (validity, causal tail), or None when the
    model's mask is plain causal (no mask given: the new tokens are the last columns)."""
    if module.training and kwargs.get("dropout", 0.0):
        raise ValueError(
            f"{type(layer.policy).__name__} scores attention in the hf_kvcache bridge, which has no attention dropout "
            "(training); call model.eval() or use a cache without attention scores."
        )
    q = query.shape[2]
    valid, causal_tail = spec if spec is not None else (None, q if q > 1 else 0)
    if q > 1 and key.shape[2] == q and not layer.forward_info.has_padding:
        valid = None  # a first prefill without padding (known on the host): every column is a real new token
    needs = layer.needs
    window = needs.window
    weight = layer.forward_info.real.to(device=query.device, dtype=torch.float32)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    out, scores = scored_attention(
        query,
        key,
        value,
        valid,
        causal_tail,
        scaling,
        softcap=kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None)) or None,
        sinks=getattr(module, "sinks", None),
        query_weight=weight,
        score_from=q - window if window is not None and q > window else 0,
        reduce=needs.reduce,
        normalize_over=needs.columns,
    )
    layer.policy.observe(layer.view, scores)
    return out, None


def _first_call(module, layer, key) -> bool:
    """Whether this is the layer's first attention call of the forward. DiffLlama's differential attention calls
    attention twice per layer, with the same queries and keys (two halves of its values): the policy observes the
    first call only (the second would place a chunk the first already placed), and both attend alike. A repeated
    call must not get the stand-ins of attention from codes (zeros, `codes_read` consumed by the first call)."""
    serial = layer.forward_info.serial
    first = getattr(layer, "_attended_forward", None) != serial
    layer._attended_forward = serial
    if not first and layer.codes_read is None and key.numel() and key.stride(-1) == 0:
        raise RuntimeError(
            f"{type(module).__name__} (layer {layer.layer_idx}) calls attention more than once per forward, and this "
            "cache handed it stand-ins to attend from its quantized codes, which the first call consumed; use "
            "attention='dequantize' with this model."
        )
    return first


def attended_layer(cache, index: int):
    """The cache layer an attention call of the module with `layer_idx` `index` reads: that layer; for a KV-sharing
    layer (Gemma 3n / 4) the compressed layer it reuses; and when the last compressed layer updated in this forward
    is another one, that one: attention follows its module's own update, and HRM's modules update the slot of their
    recurrent cycle (layer_idx + cycle offset), not their own layer_idx."""
    layer = cache.layers[index]
    if not isinstance(layer, CompressedLayer):
        producer = cache.kv_producers.get(index)
        return layer if producer is None else cache.layers[producer]
    updated = cache.forward_info.updated
    return layer if updated is None or updated == index else cache.layers[updated]


def _make_bridge(name: str):
    sdpa = name == "hf_kvcache_sdpa"

    def hf_kvcache_attention(module, query, key, value, attention_mask, **kwargs):
        inner = sdpa_attention_forward if sdpa else eager_attention_for(module)
        cache = active_cache()
        layer = None if cache is None else attended_layer(cache, module.layer_idx)
        if isinstance(layer, CompressedLayer):  # transformers' own layers (sliding, ...) need nothing from us
            first = _first_call(module, layer, key)
            needs = layer.needs
            if needs.attention and key.shape[1] != layer.heads and not layer.latent_attention:
                raise ValueError(
                    f"{type(module).__name__} (layer {layer.layer_idx}) attends with {key.shape[1]} key heads made "
                    f"from the {layer.heads} it caches (JetMoE repeats them after the cache), so "
                    f"{type(layer.policy).__name__}'s attention scores do not map to the cached heads; use a cache "
                    "that does not score attention (sink, sliding, knorm, keydiff, expected_attention, fp8, kivi)."
                )
            # stored keys are rotated: rotate the queries alike (q.k unchanged); reading from codes, `attend` does it
            # (the native kernel inside its call)
            rotation = layer.key_rotation
            if rotation is not None and (layer.codes_read is None or needs.queries):
                query, rotation = rotate(query, rotation), None
            spec = layer.attention_validity()
            if needs.queries and first:  # (may place a pending chunk: attention reads the past as it was)
                layer.policy.observe_queries(layer.view, query)
            if layer.codes_read is not None:  # attention straight from the store's codes (hf_kvcache.layers.codes_read)
                out = attend(module, layer, query, key, value, spec, kwargs, rotation)
                if out is not None:  # None: the first prefill, nothing stored yet: attend to the new tokens as usual
                    return out
            if rotation is not None:
                query = rotate(query, rotation)
            if (
                needs.attention
                and first
                and (spec is not None or attention_mask is None)
                and not (
                    not sdpa and attention_weights_requested()  # eager then returns the weights itself
                )
            ):  # output and column scores from one pass (hf_kvcache.attention.scored)
                return _attend_with_scores(module, layer, query, key, value, spec, kwargs)
            if sdpa and query.shape[2] == 1 and not needs.attention:
                # one decode token: each KV head read once, not once per query head (hf_kvcache.attention.gqa_decode);
                # the
                # layer's validity [B, Hm, kv] is the whole mask of a decode step
                mask = attention_mask if spec is None else spec[0][:, :, None, :]
                packed = packed_decode_attention(module, query, key, value, mask, kwargs)
                if packed is not None:
                    return packed
            if spec is not None:
                mask = build_validity_mask(spec[0], spec[1], query)
                if name == "hf_kvcache_eager":
                    mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                        ~mask, torch.finfo(query.dtype).min
                    )
                attention_mask = mask
            if needs.attention and first:  # the model's own mask (not causal-only): scores, 2nd pass
                weight = layer.forward_info.real.to(device=query.device, dtype=torch.float32)
                scored_query, scored_mask, window = query, attention_mask, needs.window
                if window is not None and query.shape[2] > window:  # only the last `window` queries are scored
                    scored_query, weight = query[:, :, -window:], weight[:, -window:]
                    if scored_mask.shape[2] > 1:
                        scored_mask = scored_mask[:, :, -window:]
                scores = attention_column_scores(
                    scored_query,
                    key,
                    scored_mask,
                    kwargs.get("scaling", module.scaling),
                    weight,
                    softcap=kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None)),
                    sinks=getattr(module, "sinks", None),
                    reduce=needs.reduce,
                    normalize_over=needs.columns,
                )
                layer.policy.observe(layer.view, scores)
        return inner(module, query, key, value, attention_mask, **kwargs)

    hf_kvcache_attention.__name__ = name
    return hf_kvcache_attention


def register_attention_functions() -> None:
    """Idempotent: registers the bridge attention functions and their mask builders with transformers."""
    for name in _INNER:
        AttentionInterface.register(name, _make_bridge(name))
        AttentionMaskInterface.register(name, _MASKS[name])


def _pre_hook(module, args, kwargs):
    arguments = forward_arguments(module, args, kwargs)
    cache = given_cache(arguments)  # under `cache` (5.24) or `past_key_values` (5.23, or a 5.24 caller's alias)
    if isinstance(cache, ForwardAnnounced):  # one of our caches (hf_kvcache.caches.KVCache)
        cache.before_forward(module, arguments)  # (KVzip: may run its reconstruction forwards here, nested)
        x = arguments.get("input_ids")
        if x is None:
            x = arguments.get("inputs_embeds")
        cache.begin_forward(
            x.shape[1], x.shape[0], x.device, arguments.get("attention_mask"), arguments.get("position_ids")
        )
        cache.forward_info.attention_bridged = attention_implementation(module) in _INNER
        _active_stack().append(cache)
    else:
        _active_stack().append(None)
    return None


def _post_hook(module, args, kwargs, output):
    stack = _active_stack()
    if stack:
        stack.pop()
    return None


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Switch `model` to the bridge (idempotent). Needed once before calling the model directly with one of our
    caches; `generate` and caches built with the model do it for you. Outputs with other caches are unchanged."""
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}.")
    if getattr(model, "_hf_kvcache_hooks", False) and attention_implementation(model) in _INNER:
        return model
    require(*BRIDGE_CONTRACTS)
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; hf_kvcache supports decoder-only models."
        )
    if not can_set_attention(model):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "hf_kvcache cannot apply its masks; this architecture is not supported."
        )
    register_attention_functions()
    current = attention_implementation(model)
    if current in _INNER:
        target = current
    elif current in BRIDGE_NAMES:
        target = BRIDGE_NAMES[current]
    else:
        logger.warning(
            "hf_kvcache: attention implementation %r cannot take per-slot masks; switching %s to sdpa.",
            current,
            type(model).__name__,
        )
        target = BRIDGE_NAMES["sdpa"]
    model.set_attn_implementation(target)
    if not getattr(model, "_hf_kvcache_hooks", False):
        # The top-level model and its base model (called directly by some users and libraries) both announce
        # forwards; a nested call announces the same tokens twice, which is harmless.
        for module in {id(m): m for m in (model, getattr(model, "base_model", model))}.values():
            module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
            module._hf_kvcache_hooks = True
    model._hf_kvcache_enabled = True
    return model


def is_enabled(model: PreTrainedModel) -> bool:
    return bool(getattr(model, "_hf_kvcache_hooks", False)) and attention_implementation(model) in _INNER


def disable(model: PreTrainedModel) -> None:
    """Undo the attention switch (the forward hooks stay, inert without our caches); `enable` switches back."""
    current = attention_implementation(model)
    inner = {v: k for k, v in BRIDGE_NAMES.items()}.get(current)
    if inner is not None:
        model.set_attn_implementation(inner)
    model._hf_kvcache_enabled = False
