"""What our caches need to know about a model's architecture, in one place.

- Layer types: transformers' own `get_layer_types_and_kwargs` says what each decoder layer caches
  ("full_attention", "sliding_attention", "chunked_attention", linear-attention and "dummy" layers ...). Our
  compression applies to full-attention layers; every other layer keeps exactly what the model's own cache layer
  keeps (transformers' layer class for that type), so hybrid models (Gemma 2/3, GPT-OSS, Cohere2, Mistral with a
  sliding window ...) work unchanged.
- Latent attention (MLA: DeepSeek-V2/V3 in transformers 5.x): the layer caches the compressed latent as "keys"
  ([B, 1, n, kv_lora_rank], not rotated) and the RoPE part of the keys as "values" ([B, 1, n, qk_rope_head_dim]).
  Eviction, precision and H2O scores work on them as on any key/value pair; what needs real attention keys (a
  key rotation that queries undo, re-rotating keys to new positions) does not apply and is refused by name.
- Everything else (heads, head sizes, devices) is read from the tensors at the first update, so tensor parallelism
  (each rank sees its shard of heads) needs no special case. What a cache must know before (a quantized cache's
  rotation and static scales) is the compressed layers' shape (`compressed_layer_config`: on a heterogeneous
  config, Gemma 4's, their own head_dim and KV heads).
"""

from __future__ import annotations

from ..integration.cache_layers import known_layer_types, layer_types_and_kwargs, upstream_layer_class
from ..integration.models import layer_config

#: the layer type our policies compress
COMPRESSED_TYPE = "full_attention"


def check_supported_config(config) -> None:
    """Our caches replace the KV caches of decoder-only transformers; anything else gets a clear error."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(config).__name__} is an encoder-decoder model; hf_kvcache supports decoder-only models."
        )
    for name in ("num_hidden_layers", "num_attention_heads"):
        if not hasattr(config, name):
            raise ValueError(f"{type(config).__name__} has no `{name}`; not a decoder-only transformer config.")


def layer_plan(config) -> tuple[list[str], list[dict]]:
    """(layer type, kwargs of transformers' layer class) per decoder layer, as transformers' own caches see them."""
    layer_types, kwargs = layer_types_and_kwargs(config)
    unknown = sorted({t for t in layer_types if t != COMPRESSED_TYPE and upstream_layer_class(t) is None})
    if unknown:
        raise ValueError(
            f"{type(config).__name__} has layer types {unknown} that transformers' DynamicCache does not know; "
            f"hf_kvcache supports {known_layer_types()}."
        )
    return layer_types, kwargs


def regroups_values(config) -> bool:
    """Attention reads each head's values mixed with another head's (DiffLlama splits the cached values into two
    halves of heads and repeats them, after the cache update): a head's slot must then hold the same token in every
    head, which a head-adaptive pool (one head per slot) does not."""
    return getattr(config, "model_type", None) == "diffllama"


def is_latent_attention(config) -> bool:
    """True for MLA models whose cache holds a compressed latent instead of attention keys (DeepSeek-V2/V3)."""
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_rope_head_dim")


def refuse_latent(config, what: str, parameter: str, alternative: str) -> None:
    """Raise for a setting that needs real attention keys on a latent-attention model."""
    if is_latent_attention(config):
        raise ValueError(
            f"`{parameter}`: {what} needs the cache to hold attention keys, but {type(config).__name__} (multi-head "
            "latent attention) caches a compressed latent as keys and the RoPE part of the keys as values. "
            f"Use {alternative}."
        )


def compressed_layer_config(config):
    """The config of the layers our caches compress (full attention). A heterogeneous config (Gemma 4: its full
    layers have their own head_dim and KV heads, its sliding layers keep transformers' own cache) gives the first
    such layer's view, once every full layer is checked to agree; otherwise the config itself."""
    if not getattr(config, "is_heterogeneous", False):
        return config
    layer_types, _ = layer_plan(config)
    full = [i for i, t in enumerate(layer_types) if t == COMPRESSED_TYPE]
    if not full:
        return config
    views = [layer_config(config, i) for i in full]
    shapes = {(v.num_attention_heads, getattr(v, "num_key_value_heads", None), _head_dim(v)) for v in views}
    if len(shapes) > 1:
        raise ValueError(
            f"{type(config).__name__}: its full-attention layers differ in (heads, KV heads, head_dim) "
            f"{sorted(shapes)}; hf_kvcache caches need one shape for the layers they compress."
        )
    return views[0]


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_kv_shape(config, index: int) -> tuple[int, int, int]:
    """(KV heads, key size, value size) of what decoder layer `index` caches per token: its own on a heterogeneous
    config (Gemma 4's sliding layers differ from its full layers), else the config's; on a latent-attention model
    one "head" of the latent (kv_lora_rank) as keys and the keys' RoPE part (qk_rope_head_dim) as values."""
    view = layer_config(config, index)
    if is_latent_attention(view):
        return 1, view.kv_lora_rank, view.qk_rope_head_dim
    return _kv_heads(view), _head_dim(view), _head_dim(view)


def attention_head_dim(config) -> int:
    """Size of the keys a standard attention layer caches (head_dim, or hidden_size / heads), of the layers our caches
    compress (`compressed_layer_config`)."""
    return _head_dim(compressed_layer_config(config))


def kv_head_count(config) -> int:
    """KV heads of the layers our caches compress (num_key_value_heads, or every attention head)."""
    return _kv_heads(compressed_layer_config(config))
