"""What the attention bridge (hf_kvcache.attention) takes from transformers beyond its public
`AttentionInterface` / `AttentionMaskInterface` registries.

- the attention functions it wraps: `integrations.sdpa_attention.sdpa_attention_forward` and each modeling file's
  module-level `eager_attention_forward` (Llama's where a file has none), called as
  `(module, query, key, value, attention_mask, **kwargs)`;
- the mask builders registered beside them: `masking_utils.sdpa_mask` (with `allow_is_causal_skip`) and `eager_mask`;
- whether the running forward collects attention weights: `utils.output_capturing._active_collector`;
- the model's attention switch: `PreTrainedModel._can_set_attn_implementation()`, `set_attn_implementation(name)`
  and `config._attn_implementation`;
- the forward a pre-hook sees: a model's `forward(input_ids | inputs_embeds, attention_mask, position_ids, <cache>)`
  with the cache under hf_kvcache.integration.cache_argument's names.
"""

from __future__ import annotations

import inspect
import sys

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

from .cache_argument import CACHE_ARG, CACHE_ARG_TEXT
from .cache_argument import CONTRACT as CACHE_ARGUMENT
from .contracts import contract, missing_parameters, parameters, source

ATTENTION_CALL = ["module", "query", "key", "value", "attention_mask"]
SDPA = "integrations.sdpa_attention.sdpa_attention_forward"
EAGER = "modeling_llama.eager_attention_forward"
MASKS = "masking_utils.sdpa_mask / eager_mask"
SWITCH = "PreTrainedModel attention switch"
ATTENTION_FORWARD = "decoder attention forward (cache.update)"


@contract(
    SDPA,
    "takes (module, query, key, value, attention_mask, **kwargs) and returns (output [B, q, H, D], weights)",
    "the attention bridge (every hf_kvcache cache)",
)
def _check_sdpa() -> str | None:
    return missing_parameters(sdpa_attention_forward, ATTENTION_CALL, "sdpa_attention_forward")


@contract(
    EAGER,
    "takes (module, query, key, value, attention_mask, scaling, ...) like every modeling file's eager attention",
    "the attention bridge with attn_implementation='eager'",
)
def _check_eager() -> str | None:
    return missing_parameters(eager_attention_forward, ATTENTION_CALL, "eager_attention_forward")


@contract(
    MASKS,
    "mask builders called as (batch_size, q_length, kv_length, ...); sdpa_mask takes allow_is_causal_skip",
    "the attention bridge",
)
def _check_masks() -> str | None:
    for fn in (sdpa_mask, eager_mask):
        changed = missing_parameters(fn, ["batch_size", "q_length", "kv_length"], fn.__name__)
        if changed:
            return changed
    if "allow_is_causal_skip" not in parameters(sdpa_mask):
        return "sdpa_mask no longer takes allow_is_causal_skip"
    return None


@contract(
    "utils.output_capturing._active_collector",
    "a context variable holding the outputs being collected (e.g. 'attentions') in the running forward",
    "H2O-style scores with output_attentions=True on eager models",
)
def _check_collector() -> str | None:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError as error:
        return f"import failed: {error}"
    return None if hasattr(_active_collector, "get") else "it has no get()"


@contract(
    SWITCH,
    "_can_set_attn_implementation(), set_attn_implementation(name) and config._attn_implementation",
    "the attention bridge (hf_kvcache.enable)",
)
def _check_switch() -> str | None:
    from transformers import PretrainedConfig, PreTrainedModel

    for name in ("_can_set_attn_implementation", "set_attn_implementation"):
        if not hasattr(PreTrainedModel, name):
            return f"PreTrainedModel has no {name}"
    if "_attn_implementation" not in dir(PretrainedConfig):
        return "PretrainedConfig has no _attn_implementation"
    return None


@contract(
    ATTENTION_FORWARD,
    f"a model's attention forward takes the cache as {CACHE_ARG_TEXT}, calls cache.update(key, value, layer_idx, "
    "...) with keys already rotated, then the function registered in AttentionInterface",
    "every hf_kvcache cache",
)
def _check_attention_forward() -> str | None:
    text = source(LlamaAttention.forward)
    if CACHE_ARG not in parameters(LlamaAttention.forward):
        return f"LlamaAttention.forward takes {parameters(LlamaAttention.forward)}, no {CACHE_ARG!r}"
    if f"{CACHE_ARG}.update(" not in text or "get_interface(" not in text:
        return "LlamaAttention.forward no longer calls cache.update(...) and the attention interface"
    return None


#: what the attention bridge needs to hold before it switches a model (hf_kvcache.attention.bridge.enable)
BRIDGE_CONTRACTS = (CACHE_ARGUMENT, ATTENTION_FORWARD, SDPA, EAGER, MASKS, SWITCH)


def attention_weights_requested() -> bool:
    """Whether the running forward collects attention weights (`output_attentions=True`)."""
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


_eager_functions: dict[type, object] = {}


def eager_attention_for(module):
    """The model's own eager attention (module-level `eager_attention_forward` of its modeling file), since models
    differ (GQA repeat, softcapping, sinks...); Llama's when a modeling file has none."""
    fn = _eager_functions.get(type(module))
    if fn is None:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", eager_attention_forward)
        _eager_functions[type(module)] = fn
    return fn


def attention_implementation(model) -> str | None:
    return model.config._attn_implementation


def can_set_attention(model) -> bool:
    return model._can_set_attn_implementation()


_signatures: dict[type, inspect.Signature] = {}


def forward_arguments(module, args, kwargs) -> dict:
    """A forward's arguments by name (positional ones bound to the forward's signature, extra keywords flattened)."""
    if not args:
        return kwargs
    sig = _signatures.get(type(module))
    if sig is None:
        sig = _signatures[type(module)] = inspect.signature(module.forward)
    bound = dict(sig.bind_partial(*args, **kwargs).arguments)
    for name, parameter in sig.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound.update(bound.pop(name))
    return bound


__all__ = [
    "attention_implementation",
    "attention_weights_requested",
    "can_set_attention",
    "eager_attention_for",
    "eager_mask",
    "forward_arguments",
    "sdpa_attention_forward",
    "sdpa_mask",
]
