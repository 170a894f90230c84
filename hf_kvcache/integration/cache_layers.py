"""transformers' cache layers, as our caches use them.

- `Cache` and `CacheLayerMixin` (public in `transformers.cache_utils`): our caches subclass them.
- `cache_utils.get_layer_types_and_kwargs(config)` and `DYNAMIC_LAYER_TYPE_MAPPING` (internal): what each decoder
  layer caches and transformers' layer class for it; our non-compressed layers (sliding, chunked, linear
  attention, dummy) are those classes, built exactly as DynamicCache builds them; under a cache whose compressed
  layers keep fixed shapes, windowed layers are StaticCache's (`STATIC_LAYER_TYPE_MAPPING`), so the cache compiles.
- The attributes of those layers are walked by hf_kvcache.state to save them. Which of them are state differs by
  version (5.24 stopped setting `dtype` on DynamicLayer / StaticLayer), so attributes derived from the tensors are
  never saved and are set again after loading (`DERIVED_FIELDS`, `restore_derived`): a file written on one
  supported version loads on the other.
"""

from __future__ import annotations

import functools

from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    StaticSlidingWindowLayer,
)
from transformers.cache_utils import get_layer_types_and_kwargs as _get_layer_types_and_kwargs

from .contracts import contract, missing_parameters, require, source

LAYER_TYPES = "cache_utils.get_layer_types_and_kwargs / DYNAMIC_LAYER_TYPE_MAPPING"
UPSTREAM_MODULE = "transformers.cache_utils"

#: attributes of transformers' layers that are a function of their tensors (not saved; restored on load)
DERIVED_FIELDS = frozenset({"dtype"})


@contract(
    LAYER_TYPES,
    "get_layer_types_and_kwargs(config) -> (a layer type per decoder layer, kwargs per layer), "
    "DYNAMIC_LAYER_TYPE_MAPPING: layer type -> the layer class DynamicCache builds with those kwargs",
    "every hf_kvcache cache (hybrid models' sliding / linear layers)",
)
def _check_layer_types() -> str | None:
    if not isinstance(DYNAMIC_LAYER_TYPE_MAPPING, dict) or "sliding_attention" not in DYNAMIC_LAYER_TYPE_MAPPING:
        return "DYNAMIC_LAYER_TYPE_MAPPING is not a dict with 'sliding_attention'"
    return missing_parameters(_get_layer_types_and_kwargs, ["config"], "get_layer_types_and_kwargs")


@contract(
    "CacheLayerMixin (layer interface)",
    "layers implement lazy_initialization / update / get_seq_length / "
    "get_mask_sizes / reset and the flag is_compileable",
    "every hf_kvcache cache",
)
def _check_layer_interface() -> str | None:
    missing = [
        name
        for name in ("lazy_initialization", "update", "get_seq_length", "get_mask_sizes", "reset", "is_compileable")
        if not hasattr(CacheLayerMixin, name)
    ]
    return f"CacheLayerMixin lacks {missing}" if missing else None


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    require(LAYER_TYPES)
    layer_types, kwargs = _get_layer_types_and_kwargs(config)
    return list(layer_types), list(kwargs)


KV_SHARING = "config.kv_sharing_modes (KV sharing)"


@contract(
    KV_SHARING,
    "a layer whose config.kv_sharing_modes[i] is 'reuse' attends to the keys and values of the "
    "'store' layer of its layer type (config.layer_types); get_layer_types_and_kwargs makes it a 'dummy' layer",
    "every hf_kvcache cache on Gemma 4 / 3n",
)
def _check_kv_sharing() -> str | None:
    text = source(_get_layer_types_and_kwargs)
    if "kv_sharing_modes" not in text or '"reuse"' not in text:
        return "get_layer_types_and_kwargs no longer reads kv_sharing_modes == 'reuse'"
    import transformers

    config_class = getattr(transformers, "Gemma4TextConfig", None)
    if config_class is None:
        return None
    config = config_class(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
    )
    if list(config.kv_sharing_modes) != ["store", "store", "reuse", "reuse"]:
        return f"Gemma4TextConfig's kv_sharing_modes for 2 of 4 shared layers are {config.kv_sharing_modes}"
    return None


def kv_sharing_consumers(config) -> list[bool]:
    """Per decoder layer, whether it attends to keys and values another layer cached (Gemma 3n / 4's KV sharing:
    `config.kv_sharing_modes[i] == "reuse"`, a "dummy" layer in transformers' caches), the way
    `get_layer_types_and_kwargs` reads it; all False for a model without KV sharing."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        return [False] * config.num_hidden_layers
    require(KV_SHARING)
    return [mode == "reuse" for mode in modes]


def kv_sharing_producers(config) -> list[int | None]:
    """Per decoder layer, the layer whose cached keys and values it attends to (KV sharing: a 'reuse' layer reads
    what the 'store' layer of its type put in `shared_kv_states[layer_type]`), None for a layer that uses its own."""
    consumers = kv_sharing_consumers(config)
    if not any(consumers):
        return [None] * len(consumers)
    modes, types = config.kv_sharing_modes, config.layer_types
    store = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return [store[types[i]] if consumer else None for i, consumer in enumerate(consumers)]


def upstream_layer_class(layer_type: str):
    """transformers' layer class for `layer_type` (None for a type DynamicCache does not know)."""
    return DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)


#: layer types whose layer holds at most its window (kwargs["sliding_window"]): StaticCache's class for them, sized
#: to the window, holds the same tokens with fixed shapes
WINDOWED_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding")


def upstream_layer(layer_type: str, kwargs: dict, static: bool):
    """transformers' layer for a layer we do not compress, built as DynamicCache builds it; with `static` (a cache
    whose compressed layers keep fixed shapes), a windowed layer is built as StaticCache builds it, with its window as
    its length, so that the whole cache compiles (`is_compileable`: DynamicSlidingWindowLayer is not)."""
    if static and layer_type in WINDOWED_TYPES:
        require(STATIC_LAYER_TYPES)
        return STATIC_LAYER_TYPE_MAPPING[layer_type](max_cache_len=kwargs["sliding_window"], **kwargs)
    return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)


STATIC_LAYER_TYPES = "cache_utils.STATIC_LAYER_TYPE_MAPPING (windowed layers)"


@contract(
    STATIC_LAYER_TYPES,
    "STATIC_LAYER_TYPE_MAPPING: layer type -> StaticCache's layer class, built with "
    "max_cache_len and the type's kwargs; its sliding / chunked layers hold min(max_cache_len, sliding_window) "
    "tokens for any stream length, are compileable and count the tokens seen in `cumulative_length_int`",
    "sliding / chunked layers of hybrid models under fixed-capacity caches (torch.compile, crop)",
)
def _check_static_layer_types() -> str | None:
    missing = [t for t in WINDOWED_TYPES if t not in STATIC_LAYER_TYPE_MAPPING]
    if missing:
        return f"STATIC_LAYER_TYPE_MAPPING lacks {missing}"
    layer = STATIC_LAYER_TYPE_MAPPING["sliding_attention"](max_cache_len=8, sliding_window=8)
    if not isinstance(layer, StaticSlidingWindowLayer) or getattr(layer, "cumulative_length_int", None) != 0:
        return "StaticSlidingWindowLayer no longer counts its tokens in `cumulative_length_int`"
    return (
        None
        if layer.is_compileable and layer.max_cache_len == 8
        else ("StaticSlidingWindowLayer(max_cache_len=8, sliding_window=8) is not a compileable layer of 8 tokens")
    )


def upstream_croppable(layer) -> bool:
    """Whether `crop` can put one of transformers' layers back as it was. StaticCache's windowed layer says so from its
    sizes alone (max_cache_len <= sliding_window: true of the window-sized layers `upstream_layer` builds), but once
    it has seen more tokens than its window it has dropped some, and a crop would leave it wrong."""
    if isinstance(layer, StaticSlidingWindowLayer):
        require(STATIC_LAYER_TYPES)
        return layer.cumulative_length_int <= layer.max_cache_len
    return layer.is_croppable


def known_layer_types() -> list[str]:
    return sorted(DYNAMIC_LAYER_TYPE_MAPPING)


LINEAR_STATES = "LinearAttentionLayer states"


@contract(
    LINEAR_STATES,
    "a linear-attention / convolution layer (DYNAMIC_LAYER_TYPE_MAPPING['linear_attention'], "
    "['conv']) holds its states in `conv_states` and `recurrent_states`, dicts of tensors (or None)",
    "nbytes() of hybrid models (Qwen3-Next, LFM2)",
)
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


__all__ = [
    "Cache",
    "CacheLayerMixin",
    "DERIVED_FIELDS",
    "is_upstream_layer_object",
    "known_layer_types",
    "kv_sharing_consumers",
    "kv_sharing_producers",
    "layer_types_and_kwargs",
    "restore_derived",
    "upstream_croppable",
    "upstream_layer",
    "upstream_layer_class",
    "upstream_layer_nbytes",
]
