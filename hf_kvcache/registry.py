"""Registration of our cache names with `generate(cache_implementation=..., cache_config=...)`.

transformers 5.x validates `cache_implementation` against a fixed tuple and hard-codes the name-to-class mapping in
`GenerationMixin._prepare_cache_for_generation`; we extend both, idempotently, and only on a tested version range.
"""

from __future__ import annotations

import json
import os
from typing import Any

import transformers
from packaging.version import Version
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

from .caches import H2OCache, KVCache, RandomEvictionCache, SinkCache, SlidingWindowCache
from .composite import CompositeCache
from .quantized import KIVICache, QuantizedFP8Cache

SUPPORTED_TRANSFORMERS = (Version("5.23.0"), Version("6.0.0"))
SUPPORTED_RANGE_TEXT = ">=5.23,<6"

#: cache_implementation name -> class
CACHE_IMPLEMENTATIONS: dict[str, type[KVCache]] = {
    SinkCache.cache_name: SinkCache,
    SlidingWindowCache.cache_name: SlidingWindowCache,
    H2OCache.cache_name: H2OCache,
    CompositeCache.cache_name: CompositeCache,
    RandomEvictionCache.cache_name: RandomEvictionCache,
    QuantizedFP8Cache.cache_name: QuantizedFP8Cache,
    KIVICache.cache_name: KIVICache,
}

CONFIG_FILE = "kvcache_config.json"


def builtin_cache_implementations() -> tuple[str, ...]:
    """The names transformers itself accepts (ours excluded)."""
    original = getattr(configuration_utils, "_hf_kvcache_builtin", None)
    if original is None:
        original = tuple(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) + ("paged",)
    return original


def check_transformers_version(version: str | None = None) -> None:
    version = Version(version or transformers.__version__)
    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= version < high):
        raise ImportError(
            f"hf_kvcache supports transformers {SUPPORTED_RANGE_TEXT}; found {version}. "
            f"Install a supported version: pip install 'transformers{SUPPORTED_RANGE_TEXT}'."
        )


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    name = generation_config.cache_implementation
    if name in CACHE_IMPLEMENTATIONS:
        if model_kwargs.get("past_key_values") is not None:
            raise ValueError(
                "Passing both `cache_implementation` (used to initialize certain caches) and `past_key_values` (a "
                "Cache object) is unsupported. Please use only one of the two."
            )
        if generation_config.use_cache is False:
            return None
        model_kwargs["past_key_values"] = CACHE_IMPLEMENTATIONS[name].from_cache_config(
            self, generation_config.cache_config
        )
        return None
    result = _prepare_cache_for_generation.original(self, generation_config, model_kwargs, *args, **kwargs)
    if isinstance(model_kwargs.get("past_key_values"), KVCache):
        from .attention import enable

        enable(self)
    return result


def register(name: str | None = None, cls: type[KVCache] | None = None) -> None:
    """Register all our caches (idempotent); with `name` and `cls`, add one more cache class first."""
    check_transformers_version()
    if not hasattr(configuration_utils, "_hf_kvcache_builtin"):
        configuration_utils._hf_kvcache_builtin = builtin_cache_implementations()
    names = set(CACHE_IMPLEMENTATIONS)
    if name is not None:
        if not (isinstance(cls, type) and issubclass(cls, KVCache)):
            raise ValueError(f"`cls` must be a subclass of hf_kvcache.KVCache, got {cls!r}.")
        names.add(name)
    clash = names & set(configuration_utils._hf_kvcache_builtin)
    if clash:
        raise RuntimeError(f"hf_kvcache cache names {sorted(clash)} would shadow transformers' own cache names.")
    if name is not None:
        CACHE_IMPLEMENTATIONS[name] = cls
    known = tuple(configuration_utils.ALL_CACHE_IMPLEMENTATIONS)
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = known + tuple(n for n in CACHE_IMPLEMENTATIONS if n not in known)
    current = GenerationMixin._prepare_cache_for_generation
    if getattr(current, "__name__", "") != "_prepare_cache_for_generation" or not hasattr(current, "original"):
        _prepare_cache_for_generation.original = current
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    from .attention import register_attention_functions

    register_attention_functions()


def build_cache(name: str, config_or_model, cache_config: dict[str, Any] | None = None) -> KVCache:
    """Build a registered cache by name, e.g. from a published config."""
    if name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"Unknown cache {name!r}; hf_kvcache caches are {sorted(CACHE_IMPLEMENTATIONS)}.")
    return CACHE_IMPLEMENTATIONS[name].from_cache_config(config_or_model, cache_config)


def _validation_config():
    """A minimal Llama-shaped config: building a cache against it checks every parameter value (no tensors are
    allocated before the first update)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)


def save_cache_config(directory: str | os.PathLike, name: str, cache_config: dict[str, Any], model_config=None) -> str:
    """Write `kvcache_config.json` next to a model, after checking that the config builds a cache (against
    `model_config` when given, else a minimal Llama-shaped config) and is plain JSON."""
    build_cache(name, model_config if model_config is not None else _validation_config(), cache_config)
    try:
        json.dumps(cache_config)
    except TypeError as error:
        raise ValueError(f"cache_config for {name!r} must be JSON-serialisable: {error}") from None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CONFIG_FILE)
    with open(path, "w") as f:
        json.dump({"cache_implementation": name, "cache_config": cache_config}, f, indent=2, sort_keys=True)
    return path


def load_cache_config(directory: str | os.PathLike) -> dict[str, Any]:
    """Read `kvcache_config.json`: returns {"cache_implementation": ..., "cache_config": {...}} for `generate`."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No {CONFIG_FILE} in {directory}.")
    with open(path) as f:
        data = json.load(f)
    from .config import check_keys

    check_keys(CONFIG_FILE, data, ["cache_implementation", "cache_config"])
    if data.get("cache_implementation") not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"{path}: cache_implementation {data.get('cache_implementation')!r} is not one of "
            f"{sorted(CACHE_IMPLEMENTATIONS)}."
        )
    return {"cache_implementation": data["cache_implementation"], "cache_config": data.get("cache_config") or {}}
