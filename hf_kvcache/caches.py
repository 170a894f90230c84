"""The public caches: presets of a policy and a store per layer (see hf_kvcache.layer)."""

from __future__ import annotations

import inspect
import logging
import numbers
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from .architecture import COMPRESSED_TYPE, check_supported_config, layer_plan
from .config import check_keys, require_choice, require_int
from .forward_info import ForwardInfo
from .integration.cache_layers import Cache, upstream_layer_class
from .layer import CompressedLayer
from .policies import KeepAllPolicy, SinkWindowPolicy
from .policies.heavy_hitter import AGGREGATIONS, HeavyHitterPolicy, RandomEvictionPolicy
from .policies.prompt_mode import COMPRESS_MODES, PromptCompressionPolicy
from .rope import KeyRotator
from .stores import FullPrecisionStore
from .tensor_parallel import TensorParallel

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
                    f"window; settings apply to {COMPRESSED_TYPE!r} layers only (use \"keep\")."
                )
            specs[index] = dict(value)
        else:
            raise ValueError(f"{where} must be one of {LAYER_CHOICES} or a dict of settings, got {value!r}.")
    return specs


def layer_nbytes(layer) -> int:
    """Bytes held by one cache layer: ours count everything they hold; transformers' layers their keys and values."""
    if hasattr(layer, "nbytes"):
        return layer.nbytes()
    if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None:
        return 0
    return layer.keys.nbytes + layer.values.nbytes


class KVCache(Cache):
    """Base of all hf_kvcache caches: one layer per decoder layer, sharing one `ForwardInfo`.

    Full-attention layers are `CompressedLayer`s (this cache's policy x store, or per-layer settings from `layers`);
    sliding/chunked, linear-attention and dummy layers are transformers' own layer classes for that type (see
    hf_kvcache.architecture)."""

    #: name for `generate(cache_implementation=...)`; set by each public class
    cache_name: str = ""
    #: arguments that together give the cache's size: a per-layer setting naming any of them replaces them all
    size_keys: tuple[str, ...] = ()

    def __new__(cls, *args, **kwargs):
        # Remember the constructor's arguments, so per-layer settings can be merged over them (see `layers`).
        self = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
        except TypeError:
            bound = {}
        self._given = {k: v for k, v in bound.items() if k not in ("self", "config_or_model", "layers")}
        self._given_layers = bound.get("layers")  # recorded with the settings by hf_kvcache.state
        return self

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
        for i, (layer_type, kwargs, spec) in enumerate(zip(layer_types, layer_kwargs, specs)):
            if layer_type != COMPRESSED_TYPE:
                built.append(upstream_layer_class(layer_type)(**kwargs))
            elif spec is None:
                policy, store = layer_factory(config)
                if getattr(self, "compress", "always") == "prompt":  # see hf_kvcache.policies.prompt_mode
                    policy = PromptCompressionPolicy(policy)
                built.append(CompressedLayer(policy, store, forward_info=self.forward_info, layer_idx=i))
            elif spec == "keep":
                built.append(CompressedLayer(KeepAllPolicy(), FullPrecisionStore(), self.forward_info, i))
            else:
                built.append(self._layer_from_settings(config, spec, i))
        for layer in built:  # named in the error for a budget larger than memory (CompressedLayer._check_budget_fits)
            if isinstance(layer, CompressedLayer) and not hasattr(layer, "size_parameters"):
                layer.size_parameters = self.size_keys or ("max_length",)
        if not any(isinstance(layer, CompressedLayer) for layer in built):
            logger.warning(
                "hf_kvcache: %s has no full-attention layer to compress (layer types %s); every layer keeps the "
                "model's own cache.", type(config).__name__, sorted(set(layer_types))
            )
        super().__init__(layers=built)
        if model is not None:
            from .attention import enable

            enable(model)

    def _layer_from_settings(self, config, settings: dict, index: int) -> CompressedLayer:
        """Layer `index` of the cache these settings describe (merged over this cache's own arguments, or another
        registered cache's with `"cache": NAME`), rebound to this cache's forward bookkeeping."""
        settings = dict(settings)
        name = settings.pop("cache", None)
        if name is None:
            cls, base = type(self), dict(self._given)
        else:
            from .registry import CACHE_IMPLEMENTATIONS

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
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

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
                layer.policy.end_prompt(layer)

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
    def from_cache_config(cls, config_or_model, cache_config: dict[str, Any] | None) -> "KVCache":
        """Build from a `generate(cache_config=...)` dict; unknown keys raise with the list of valid ones."""
        cache_config = dict(cache_config or {})
        check_keys(f"cache_config for cache_implementation={cls.cache_name!r}", cache_config, cls.config_keys())
        return cls(config_or_model, **cache_config)


class SlidingWindowCache(KVCache):
    """The last `window` tokens of each row (window attention with a rolling buffer)."""

    cache_name = "sliding"
    size_keys = ("window",)

    def __init__(self, config_or_model, window: int = 1024, compress: str = "always",
                 layers: dict | list | None = None):
        window = require_int("window", window, 1)
        self.window = window
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        super().__init__(config_or_model, lambda cfg: (SinkWindowPolicy(0, window), FullPrecisionStore()), layers)


class SinkCache(KVCache):
    """StreamingLLM (arXiv 2309.17453): the first `sinks` tokens of each row plus the last `window` tokens.

    Give either `window` or the total `budget` (= sinks + window). `position_mode="cache"` (default) places the
    sinks just before the window, as StreamingLLM does; `"original"` keeps their original positions."""

    cache_name = "sink"
    size_keys = ("window", "budget")

    def __init__(
        self,
        config_or_model,
        sinks: int = 4,
        window: int | None = None,
        budget: int | None = None,
        position_mode: str = "cache",
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        sinks = require_int("sinks", sinks, 0)
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        if (window is None) == (budget is None):
            raise ValueError(f"Give exactly one of `window` or `budget` (got window={window!r}, budget={budget!r}).")
        if budget is not None:
            budget = require_int("budget", budget, 1)
            if sinks >= budget:
                raise ValueError(
                    f"`sinks` ({sinks}) must be smaller than `budget` ({budget}): the window needs at least one slot."
                )
            window = budget - sinks
        window = require_int("window", window, 1)
        position_mode = require_choice("position_mode", position_mode, POSITION_MODES)
        self.sinks, self.window, self.position_mode = sinks, window, position_mode
        rotators = {}  # one per cache, built after the base class checked the architecture

        def layer_parts(cfg):
            if position_mode == "cache" and "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg)
            return SinkWindowPolicy(sinks, window, rotators.get("rotator")), FullPrecisionStore()

        super().__init__(config_or_model, layer_parts, layers)
        KeyRotator.check_cache(self, config_or_model)  # built with a model: its own RoPE must agree


def _size_or_ratio(name: str, value):
    """A token count (int >= 0) or a ratio of the prompt length (float in (0, 1])."""
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"`{name}` as a ratio of the prompt length must be in (0, 1], got {value}.")
        return value
    return require_int(name, value, 0)


class H2OCache(KVCache):
    """H2O (arXiv 2306.14048): per row and KV head, the `recent` last tokens plus the `heavy` older tokens that
    received the most attention. Sizes are token counts, or ratios of the prompt length (floats in (0, 1]).

    Give `heavy` and `recent`, or a `budget` (tokens) split evenly, or a budget and one of the two. Scores come from
    the attention bridge (see docs/design.md); `aggregation` combines the query heads of a GQA group ("sum" as in
    the paper's per-head scores added up, "mean", or "max"). For long prompts, `generate(prefill_chunk_size=N)`
    evicts between chunks so peak memory stays near the budget. `position_mode="compact"` places the kept tokens at
    contiguous positions ending at the newest (re-rotating from a copy of the keys as they arrived, which costs
    one more key buffer); "original" (default) leaves every key at its own position."""

    cache_name = "h2o"
    size_keys = ("heavy", "recent", "budget")

    def __init__(
        self,
        config_or_model,
        heavy: int | float | None = None,
        recent: int | float | None = None,
        budget: int | None = None,
        aggregation: str = "sum",
        position_mode: str = "original",
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        aggregation = require_choice("aggregation", aggregation, AGGREGATIONS)
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        position_mode = require_choice("position_mode", position_mode, ("original", "compact"))
        heavy = None if heavy is None else _size_or_ratio("heavy", heavy)
        recent = None if recent is None else _size_or_ratio("recent", recent)
        if budget is not None:
            budget = require_int("budget", budget, 1)
            if isinstance(heavy, float) or isinstance(recent, float):
                raise ValueError("`budget` is a token count; give `heavy`/`recent` as token counts with it, not ratios.")
            if heavy is None and recent is None:
                heavy = budget // 2
                recent = budget - heavy
            elif heavy is None:
                heavy = budget - recent
            elif recent is None:
                recent = budget - heavy
            if heavy < 0 or recent < 0 or heavy + recent > budget:
                raise ValueError(
                    f"`heavy` + `recent` ({heavy} + {recent}) must fit in `budget` ({budget}), each >= 0."
                )
        elif heavy is None or recent is None:
            raise ValueError("Give `heavy` and `recent` (tokens or prompt ratios), or a `budget` in tokens.")
        if not isinstance(heavy, float) and not isinstance(recent, float) and heavy + recent < 1:
            raise ValueError("`heavy` + `recent` must be at least 1 token.")
        self.heavy, self.recent, self.aggregation, self.position_mode = heavy, recent, aggregation, position_mode
        make_policy = getattr(self, "_policy_factory", HeavyHitterPolicy)
        rotators = {}

        def layer_parts(cfg):
            if position_mode == "compact" and "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg)
            return make_policy(heavy, recent, aggregation, rotators.get("rotator")), FullPrecisionStore()

        super().__init__(config_or_model, layer_parts, layers)
        KeyRotator.check_cache(self, config_or_model)  # built with a model: its own RoPE must agree


class RandomEvictionCache(H2OCache):
    """Baseline: the `recent` last tokens plus `heavy` older tokens chosen uniformly at random (seeded), per row
    and KV head. Same budget arguments as H2OCache; what H2O must beat at the same budget."""

    cache_name = "random_eviction"

    def __init__(
        self,
        config_or_model,
        heavy: int | float | None = None,
        recent: int | float | None = None,
        budget: int | None = None,
        seed: int = 0,
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        seed = require_int("seed", seed, 0)
        self.seed = seed
        self._policy_factory = lambda heavy, recent, aggregation, rotator: RandomEvictionPolicy(
            heavy, recent, seed, self.tensor_parallel)  # draws keyed by global KV head under tensor parallelism
        super().__init__(config_or_model, heavy=heavy, recent=recent, budget=budget, compress=compress, layers=layers)


class FullCache(KVCache):
    """Every token in full precision through the same machinery: the reference for tests and benchmarks."""

    cache_name = "hf_kvcache_full"

    def __init__(self, config_or_model, layers: dict | list | None = None):
        super().__init__(config_or_model, lambda cfg: (KeepAllPolicy(), FullPrecisionStore()), layers)
