"""transformers' cache layers, as our caches use them.

- `Cache` and `CacheLayerMixin` (public in `transformers.cache_utils`): our caches subclass them.
- `cache_utils.get_layer_types_and_kwargs(config)` and `DYNAMIC_LAYER_TYPE_MAPPING` (internal): what each decoder
  layer caches and transformers' layer class for it; our non-compressed layers (sliding, chunked, linear
  attention, dummy) are those classes, built exactly as DynamicCache builds them.
- The attributes of those layers are walked by hf_kvcache.state to save them. Which of them are state differs by
  version (5.24 stopped setting `dtype` on DynamicLayer / StaticLayer), so attributes derived from the tensors are
  never saved and are set again after loading (`DERIVED_FIELDS`, `restore_derived`): a file written on one
  supported version loads on the other.
"""

from __future__ import annotations

import functools

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, DynamicLayer
from transformers.cache_utils import get_layer_types_and_kwargs as _get_layer_types_and_kwargs

from .contracts import contract, missing_parameters, require, source

LAYER_TYPES = "cache_utils.get_layer_types_and_kwargs / DYNAMIC_LAYER_TYPE_MAPPING"
UPSTREAM_MODULE = "transformers.cache_utils"

#: attributes of transformers' layers that are a function of their tensors (not saved; restored on load)
DERIVED_FIELDS = frozenset({"dtype"})


@contract(LAYER_TYPES, "get_layer_types_and_kwargs(config) -> (a layer type per decoder layer, kwargs per layer), "
          "DYNAMIC_LAYER_TYPE_MAPPING: layer type -> the layer class DynamicCache builds with those kwargs",
          "every hf_kvcache cache (hybrid models' sliding / linear layers)")
def _check_layer_types() -> str | None:
    if not isinstance(DYNAMIC_LAYER_TYPE_MAPPING, dict) or "sliding_attention" not in DYNAMIC_LAYER_TYPE_MAPPING:
        return "DYNAMIC_LAYER_TYPE_MAPPING is not a dict with 'sliding_attention'"
    return missing_parameters(_get_layer_types_and_kwargs, ["config"], "get_layer_types_and_kwargs")


@contract("CacheLayerMixin (layer interface)", "layers implement lazy_initialization / update / get_seq_length / "
          "get_mask_sizes / reset and the flag is_compileable",
          "every hf_kvcache cache")
def _check_layer_interface() -> str | None:
    missing = [name for name in ("lazy_initialization", "update", "get_seq_length", "get_mask_sizes", "reset",
                                 "is_compileable") if not hasattr(CacheLayerMixin, name)]
    return f"CacheLayerMixin lacks {missing}" if missing else None


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    require(LAYER_TYPES)
    layer_types, kwargs = _get_layer_types_and_kwargs(config)
    return list(layer_types), list(kwargs)


KV_SHARING = "config.kv_sharing_modes (KV sharing)"


@contract(KV_SHARING, "a layer whose config.kv_sharing_modes[i] is 'reuse' attends to keys and values another layer "
          "cached; get_layer_types_and_kwargs makes it a 'dummy' layer", "every hf_kvcache cache on Gemma 4 / 3n")
def _check_kv_sharing() -> str | None:
    text = source(_get_layer_types_and_kwargs)
    return None if "kv_sharing_modes" in text and '"reuse"' in text else (
        "get_layer_types_and_kwargs no longer reads kv_sharing_modes == 'reuse'")


def kv_sharing_consumers(config) -> list[bool]:
    """Per decoder layer, whether it attends to keys and values another layer cached (Gemma 3n / 4's KV sharing:
    `config.kv_sharing_modes[i] == "reuse"`, a "dummy" layer in transformers' caches), the way
    `get_layer_types_and_kwargs` reads it; all False for a model without KV sharing."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        return [False] * config.num_hidden_layers
    require(KV_SHARING)
    return [mode == "reuse" for mode in modes]


def upstream_layer_class(layer_type: str):
    """transformers' layer class for `layer_type` (None for a type DynamicCache does not know)."""
    return DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)


def known_layer_types() -> list[str]:
    return sorted(DYNAMIC_LAYER_TYPE_MAPPING)


LINEAR_STATES = "LinearAttentionLayer states"


@contract(LINEAR_STATES, "a linear-attention / convolution layer (DYNAMIC_LAYER_TYPE_MAPPING['linear_attention'], "
          "['conv']) holds its states in `conv_states` and `recurrent_states`, dicts of tensors (or None)",
          "nbytes() of hybrid models (Qwen3-Next, LFM2)")
def _check_linear_states() -> str | None:
    layer_class = DYNAMIC_LAYER_TYPE_MAPPING.get("linear_attention")
    if layer_class is None:
        return "DYNAMIC_LAYER_TYPE_MAPPING has no 'linear_attention'"
    layer = layer_class()
    missing = [name for name in ("conv_states", "recurrent_states") if not isinstance(getattr(layer, name, None), dict)]
    return f"{layer_class.__name__}() has no dict {missing}" if missing else None


def upstream_layer_nbytes(layer) -> int:
    """Bytes one of transformers' layers holds: its keys and values once initialized (full, sliding, chunked), and a
    linear-attention / convolution layer's conv and recurrent states (`conv_states` / `recurrent_states`, dicts of
    tensors or None, on 5.23 and 5.24 alike; fixed-size, whatever the stream's length)."""
    if hasattr(layer, "conv_states"):
        require(LINEAR_STATES)
    total = 0
    if getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
        total += layer.keys.nbytes + layer.values.nbytes
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            total += sum(t.nbytes for t in states.values() if t is not None)
    return total


def is_upstream_layer_object(obj) -> bool:
    """Objects of transformers' cache module whose attributes hf_kvcache.state walks."""
    return type(obj).__module__ == UPSTREAM_MODULE


@functools.cache
def _sets_dtype() -> bool:
    """Whether this transformers' layers set `dtype` at initialisation (5.23 does, 5.24 does not): read once."""
    return "self.dtype" in source(DynamicLayer.lazy_initialization)


def restore_derived(layer) -> None:
    """After loading a transformers layer's saved fields: set again what this version derives from its tensors."""
    keys = getattr(layer, "keys", None)
    if _sets_dtype() and getattr(layer, "is_initialized", False) and keys is not None:
        layer.dtype = keys.dtype


__all__ = ["Cache", "CacheLayerMixin", "DERIVED_FIELDS", "is_upstream_layer_object", "known_layer_types",
           "kv_sharing_consumers", "layer_types_and_kwargs", "restore_derived", "upstream_layer_class",
           "upstream_layer_nbytes"]
