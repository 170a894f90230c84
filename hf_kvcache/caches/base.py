"""The public caches: presets of a policy and a store per layer (see hf_kvcache.layers.layer)."""

from __future__ import annotations

import inspect
import logging
import numbers
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from ..common.architecture import COMPRESSED_TYPE, check_supported_config, is_latent_attention, layer_plan
from ..common.tensor_parallel import TensorParallel
from ..common.validation import check_keys, require_int
from ..integration.cache_layers import (
    Cache,
    CacheLayerMixin,
    kv_sharing_consumers,
    kv_sharing_producers,
    upstream_croppable,
    upstream_layer,
    upstream_layer_nbytes,
)
from ..layers.forward_info import ForwardAnnounced, ForwardInfo
from ..layers.layer import CompressedLayer
from ..policies import KeepAllPolicy
from ..policies.prompt_mode import PromptCompressionPolicy
from ..stores import FullPrecisionStore

POSITION_MODES = ("cache", "original")
logger = logging.getLogger(__name__)


LAYER_CHOICES = ("keep", "default")


def _layer_specs(layers, layer_types: list[str]) -> list:
    """Per-layer settings from a cache's `layers` argument: None (the cache's own settings), "keep" (every token in
    full precision on a full-attention layer; the model's window on a sliding layer), or a dict of settings for that
    layer (merged over the cache's own; `{"cache": NAME, ...}` switches to another registered cache). `layers` is a
    dict keyed by layer type ("full_attention", "sliding_attention", ...) and/or layer index, or a list with one
    entry per layer. Index entries win over type entries."""
    n = len(layer_types)
    specs: list = [None] * n
    if layers is None:
        return specs
    if isinstance(layers, (list, tuple)):
        if len(layers) != n:
            raise ValueError(f"`layers` as a list needs one entry per decoder layer ({n}), got {len(layers)}.")
        entries = [(i, i, value) for i, value in enumerate(layers)]
    elif isinstance(layers, dict):
        by_type, by_index = [], []
        for key, value in layers.items():
            if isinstance(key, str) and not key.lstrip("-").isdigit():
                if key not in layer_types:
                    raise ValueError(
                        f"`layers` key {key!r} is not a layer type of this model; its layer types are "
                        f"{sorted(set(layer_types))} (or give layer indices 0..{n - 1})."
                    )
                by_type += [(key, i, value) for i, t in enumerate(layer_types) if t == key]
            else:
                if not isinstance(key, (str, numbers.Integral)) or isinstance(key, bool):  # not int(1.5) -> layer 1
                    raise ValueError(
                        f"`layers` key {key!r} ({type(key).__name__}) must be a layer type or a layer index 0..{n - 1}."
                    )
                index = int(key)
                if not 0 <= index < n:
                    raise ValueError(f"`layers` key {key!r}: layer index must be in 0..{n - 1}.")
                by_index.append((key, index, value))
        entries = by_type + by_index
    else:
        raise ValueError(
            f"`layers` must be a dict (by layer type or index) or a list (one entry per layer), got "
            f"{type(layers).__name__}."
        )
    for key, index, value in entries:
        where = f"layers[{key!r}]"
        if value is None or value == "default":
            specs[index] = None
        elif value == "keep":
            specs[index] = "keep"
        elif isinstance(value, dict):
            if layer_types[index] != COMPRESSED_TYPE:
                raise ValueError(
                    f"{where}: layer {index} is a {layer_types[index]!r} layer, which keeps exactly the model's own "
                    f'window; settings apply to {COMPRESSED_TYPE!r} layers only (use "keep").'
                )
            specs[index] = dict(value)
        else:
            raise ValueError(f"{where} must be one of {LAYER_CHOICES} or a dict of settings, got {value!r}.")
    return specs


def layer_nbytes(layer) -> int:
    """Bytes held by one cache layer: ours count everything they hold; transformers' layers their keys and values,
    or a linear-attention / convolution layer's states (`upstream_layer_nbytes`)."""
    if hasattr(layer, "nbytes"):
        return layer.nbytes()
    return upstream_layer_nbytes(layer)


class KVCache(Cache, ForwardAnnounced):
    """Base of all hf_kvcache caches: one layer per decoder layer, sharing one `ForwardInfo`.

    Full-attention layers are `CompressedLayer`s (this cache's policy x store, or per-layer settings from `layers`);
    sliding/chunked, linear-attention and dummy layers are transformers' own layer classes for that type (see
    hf_kvcache.common.architecture): DynamicCache's, or StaticCache's windowed layers when every compressed layer
    keeps fixed shapes (then the whole cache is compileable; `upstream_layer`)."""

    #: name for `generate(cache_implementation=...)`; set by each public class
    cache_name: str = ""
    #: arguments that together give the cache's size: a per-layer setting naming any of them replaces them all
    size_keys: tuple[str, ...] = ()

    def __new__(cls, config_or_model=None, *args, **kwargs):
        # The settings as given (not the defaults): per-layer settings are merged over them (see `layers`), and
        # hf_kvcache.sharing.state writes them (a file's defaults revision fills in the ones not given).
        self = super().__new__(cls)
        self._given, self._given_layers = cls._settings_given(args, kwargs)
        return self

    @classmethod
    def _settings_given(cls, args: tuple, kwargs: dict) -> tuple[dict, Any]:
        """(the constructor's arguments after `config_or_model` that the call gave, by name, in `config_keys`
        order, `layers` left out; the `layers` given or None). Positional arguments are named by `config_keys`;
        a call the constructor will refuse anyway records whatever it names."""
        keys = cls.config_keys()
        given = {**dict(zip(keys, args)), **kwargs}
        settings = {key: given[key] for key in keys if key in given and key != "layers"}
        return settings, given.get("layers")

    def __init__(self, config_or_model, layer_factory, layers=None):
        model = config_or_model if isinstance(config_or_model, PreTrainedModel) else None
        config = model.config if model is not None else config_or_model
        if not isinstance(config, PretrainedConfig):
            raise ValueError(
                f"The first argument must be a transformers model or its config, got {type(config_or_model).__name__}."
            )
        config = config.get_text_config(decoder=True)
        check_supported_config(config)
        self.config = config
        self.tensor_parallel = TensorParallel.of(config_or_model)  # rank, group: a model sharded by transformers
        self.forward_info = ForwardInfo()
        layer_types, layer_kwargs = layer_plan(config)
        self.layer_types = layer_types
        specs = _layer_specs(layers, layer_types)
        built = []
        for i, (layer_type, _kwargs, spec) in enumerate(zip(layer_types, layer_kwargs, specs)):
            if layer_type != COMPRESSED_TYPE:
                built.append(None)  # transformers' layer, built below (its class follows the compressed layers')
            elif spec is None:
                policy, store = layer_factory(config)
                if getattr(self, "compress", "always") == "prompt":  # see hf_kvcache.policies.prompt_mode
                    policy = PromptCompressionPolicy(policy)
                built.append(CompressedLayer(policy, store, forward_info=self.forward_info, layer_idx=i))
            elif spec == "keep":
                built.append(CompressedLayer(KeepAllPolicy(), FullPrecisionStore(), self.forward_info, i))
            else:
                built.append(self._layer_from_settings(config, spec, i))
        compressed = [layer for layer in built if isinstance(layer, CompressedLayer)]
        static = bool(compressed) and all(layer.is_compileable for layer in compressed)  # fixed shapes: compile all
        built = [
            upstream_layer(layer_type, kwargs, static) if layer is None else layer
            for layer, layer_type, kwargs in zip(built, layer_types, layer_kwargs)
        ]
        latent = is_latent_attention(config)
        shared = any(kv_sharing_consumers(config))  # later layers attend to earlier layers' caches
        #: consumer layer index -> the index of the compressed layer whose keys and values it attends to (the bridge
        #: attends as that layer; an index, since a cache may replace its layers: KVzip places them at the prompt's end)
        self.kv_producers = {
            i: j
            for i, j in enumerate(kv_sharing_producers(config))
            if j is not None and isinstance(built[j], CompressedLayer)
        }
        for layer in built:  # named in the error for a budget larger than memory (CompressedLayer._check_budget_fits)
            if isinstance(layer, CompressedLayer) and not hasattr(layer, "size_parameters"):
                layer.size_parameters = self.size_keys or ("max_length",)
            if isinstance(layer, CompressedLayer):  # (the model expands a latent before attention: codes_read)
                layer.latent_attention = latent
                # later layers attend to what these hand out (KV sharing): real keys and values, never stand-ins
                layer.kv_shared = shared
        if not any(isinstance(layer, CacheLayerMixin) for layer in built):
            raise ValueError(
                f"{type(config).__name__} has no attention layer (layer types {sorted(set(layer_types))}): its "
                "layers keep recurrent or convolution states, not keys and values, so there is no KV cache to "
                "compress; generate with the model's own cache."
            )
        if not any(isinstance(layer, CompressedLayer) for layer in built):
            logger.warning(
                "hf_kvcache: %s has no full-attention layer to compress (layer types %s); every layer keeps the "
                "model's own cache.",
                type(config).__name__,
                sorted(set(layer_types)),
            )
        super().__init__(layers=built)
        if model is not None:
            from ..attention.bridge import enable

            enable(model)

    def _layer_from_settings(self, config, settings: dict, index: int) -> CompressedLayer:
        """Layer `index` of the cache these settings describe (merged over this cache's own arguments, or another
        registered cache's with `"cache": NAME`), rebound to this cache's forward bookkeeping."""
        settings = dict(settings)
        name = settings.pop("cache", None)
        if name is None:
            cls, base = type(self), dict(self._given)
        else:
            from .catalog import CACHE_IMPLEMENTATIONS

            if name not in CACHE_IMPLEMENTATIONS:
                raise ValueError(
                    f"layers[{index}]: `cache` must be one of {sorted(CACHE_IMPLEMENTATIONS)}, got {name!r}."
                )
            cls, base = CACHE_IMPLEMENTATIONS[name], {}
        check_keys(f"layers[{index}] settings for {cls.cache_name!r}", settings, cls.config_keys())
        if any(k in settings for k in cls.size_keys):  # a layer's own size replaces the cache's, whichever form
            base = {k: v for k, v in base.items() if k not in cls.size_keys}
        other = cls(config, **{**base, **settings})
        layer = other.layers[index]
        layer.forward_info = self.forward_info
        return layer

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can put every layer back as it was (assisted decoding): ours until they evict, transformers'
        own as `upstream_croppable` says (a window-sized StaticCache layer only while it holds every token seen)."""
        return all(
            layer.is_croppable if isinstance(layer, CompressedLayer) else upstream_croppable(layer)
            for layer in self.layers
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every layer (assisted decoding), or raise before changing any of them."""
        if tokens_to_remove < 0:
            for i, layer in enumerate(self.layers):
                if isinstance(layer, CompressedLayer):
                    if not layer.is_croppable:
                        layer.crop(tokens_to_remove)  # (raises, naming what it evicted)
                elif not upstream_croppable(layer):
                    raise ValueError(
                        f"Cannot crop layer {i} ({type(layer).__name__}, window {layer.max_cache_len}): it has seen "
                        f"{layer.get_seq_length()} tokens and dropped those before its window, which a crop cannot "
                        "bring back. Assisted decoding on this hybrid model needs a stream within the window, or a "
                        "growing cache (fp8 / kivi without `max_length`, whose sliding layers are DynamicCache's)."
                    )
        super().crop(tokens_to_remove)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def begin_forward(self, q_len, batch, device, attention_mask=None, position_ids=None) -> None:
        seen = next((layer.seen for layer in self.compressed_layers), None)
        if seen is None:
            seen = self.get_seq_length()
        self.forward_info.begin(q_len, batch, device, seen, attention_mask, position_ids)

    def end_prompt(self) -> None:
        """With `compress="prompt"`: end the prompt now (it otherwise ends at the first one-token forward); the
        tokens of later forwards are appended uncompressed. No effect in "always" mode."""
        for layer in self.compressed_layers:
            if isinstance(layer.policy, PromptCompressionPolicy):
                layer.policy.end_prompt(layer.view)

    def state_phase(self) -> dict:
        """For state files (hf_kvcache.sharing.state): what a fresh cache must become before the saved layers are
        written into it, for caches whose layers change kind during a stream (KVzip). Default: nothing."""
        return {}

    def enter_state_phase(self, phase: dict, where: str) -> None:
        """Become what `state_phase()` described (before a state file's layers are loaded)."""

    def nbytes(self) -> int:
        """Bytes this cache holds: buffers as allocated, scales and metadata included, every layer type."""
        return sum(layer_nbytes(layer) for layer in self.layers)

    def reset(self):
        super().reset()
        self.forward_info.reset()

    @classmethod
    def config_keys(cls) -> list[str]:
        params = inspect.signature(cls.__init__).parameters
        return [name for name in params if name not in ("self", "config_or_model")]

    @classmethod
    def bundle(cls, cache_config: dict[str, Any], model_dir: str) -> dict[str, Any]:
        """The settings as published with the saved model in `model_dir` (hf_kvcache.publish). A cache whose
        settings name files of its own (KVzap's trained surrogate) copies them into the folder and refers to them
        relative to the model, so the folder, or the Hub repo it is uploaded to, carries them. Default: unchanged."""
        return cache_config

    @classmethod
    def from_cache_config(cls, config_or_model, cache_config: dict[str, Any] | None) -> KVCache:
        """Build from a `generate(cache_config=...)` dict; unknown keys raise with the list of valid ones."""
        cache_config = dict(cache_config or {})
        check_keys(f"cache_config for cache_implementation={cls.cache_name!r}", cache_config, cls.config_keys())
        return cls(config_or_model, **cache_config)


def _size_or_ratio(name: str, value):
    """A token count (int >= 0) or a ratio of the prompt length (float in (0, 1])."""
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"`{name}` as a ratio of the prompt length must be in (0, 1], got {value}.")
        return value
    return require_int(name, value, 0)


class FullCache(KVCache):
    """Every token in full precision through the same machinery: the reference for tests and benchmarks."""

    cache_name = "hf_kvcache_full"

    def __init__(self, config_or_model, layers: dict | list | None = None):
        super().__init__(config_or_model, lambda cfg: (KeepAllPolicy(), FullPrecisionStore()), layers)
