"""One way to name a cache everywhere in the harness: `(name, cache_config)`.

`name` is a key of `hf_kvcache.CACHE_IMPLEMENTATIONS` (ours: "sink", "sliding", "h2o", ... and whatever registers
later, picked up automatically), "hf_kvcache_full" (`FullCache`: keep-all through our machinery) or one of
transformers' own caches:

- "dynamic": `DynamicCache` (no keys), the full-cache reference;
- "offloaded": `DynamicCache(offloading=True)` (no keys);
- "static": `StaticCache` (`max_cache_len`, default: the context length plus the tokens scored or generated);
- "quantized": `QuantizedCache` (`backend` "quanto" | "hqq" | "fp8", `nbits`, `axis_key`, `axis_value`,
  `q_group_size`, `residual_length`).

Budgets: the keys in `BUDGET_KEYS` ("budget" of sink/h2o, "window" of sink/sliding, "heavy"/"recent" of h2o,
"max_cache_len" of static) take an absolute number of tokens (int >= 1) or a fraction of the context length: a
float in (0, 1] or a string such as "25%". The harness resolves fractions to tokens (`round(fraction * context)`,
at least 1) before the cache sees them, so every cache is compared at the same number of tokens.

`check_cache` validates a spec without a model (it builds the cache against a tiny config, so the cache's own
checks run too) and `make_cache` builds it for a model. Errors name the field and list what is valid.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUDGET_KEYS",
    "BUILTIN_CACHES",
    "CacheSpec",
    "available_caches",
    "check_cache",
    "make_cache",
    "make_factory",
    "resolve_config",
]

#: config keys that accept a fraction of the context length
BUDGET_KEYS = ("budget", "window", "heavy", "recent", "max_cache_len")

#: transformers' own caches the harness can build, with their config keys
BUILTIN_CACHES: dict[str, tuple[str, ...]] = {
    "dynamic": (),
    "offloaded": (),
    "static": ("max_cache_len",),
    "quantized": ("backend", "nbits", "axis_key", "axis_value", "q_group_size", "residual_length"),
}
QUANTIZED_BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}


def _ours() -> dict:
    """Registered caches, plus our keep-all `FullCache` ("hf_kvcache_full": the reference through our machinery)."""
    from ..caches.base import FullCache  # importing hf_kvcache also registers the names
    from ..caches.registry import CACHE_IMPLEMENTATIONS

    return {**CACHE_IMPLEMENTATIONS, FullCache.cache_name: FullCache}


def available_caches() -> dict[str, list[str]]:
    """{"hf_kvcache": [...], "transformers": [...]}: every name the harness accepts."""
    return {"hf_kvcache": sorted(_ours()), "transformers": sorted(BUILTIN_CACHES)}


def _names_text() -> str:
    names = available_caches()
    return f"hf_kvcache caches {names['hf_kvcache']}, transformers caches {names['transformers']}"


def config_keys(name: str) -> list[str]:
    if name in BUILTIN_CACHES:
        return list(BUILTIN_CACHES[name])
    return list(_ours()[name].config_keys())


@dataclass(frozen=True)
class CacheSpec:
    """A cache by name and config; `label` is what tables and plots show (default: name and config)."""

    name: str
    config: dict = field(default_factory=dict)
    label: str | None = None

    def display(self) -> str:
        if self.label:
            return self.label
        if not self.config:
            return self.name
        return self.name + " " + " ".join(f"{k}={v}" for k, v in sorted(self.config.items()))


def _fraction(value: Any) -> float | None:
    """A fraction of the context if `value` is a float or an "N%" string, else None."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1]) / 100.0
        except ValueError:
            return None
    if isinstance(value, float):
        return value
    return None


def resolve_config(name: str, config: dict | None, context_len: int | None = None, where: str = "cache_config") -> dict:
    """`config` with budget fractions turned into token counts; unknown names, unknown keys and bad budgets raise
    ValueError naming `where` and the key."""
    if not isinstance(name, str) or not (name in BUILTIN_CACHES or name in _ours()):
        raise ValueError(f"{where}: unknown cache {name!r}; valid names are {_names_text()}.")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the config of cache {name!r} must be a mapping, got {type(config).__name__}.")
    valid = config_keys(name)
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} for cache {name!r}; valid keys are {sorted(valid)}.")
    out = dict(config)
    for key in BUDGET_KEYS:
        if key not in out or out[key] is None:
            continue
        value = out[key]
        frac = _fraction(value)
        if frac is not None:
            if not (0.0 < frac <= 1.0):
                raise ValueError(
                    f"{where}.{key}: a budget fraction must be in (0, 1] (or 'N%' with 0 < N <= 100), got {value!r}."
                )
            if context_len is None:
                raise ValueError(f"{where}.{key}: the fraction {value!r} needs a context length to resolve against.")
            out[key] = max(1, int(round(frac * context_len)))
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{where}.{key}: a budget is a number of tokens (integer >= 1) or a fraction of the context "
                f"(float in (0, 1] or 'N%'), got {value!r}."
            )
        else:
            out[key] = int(value)
    if name == "quantized":
        backend = out.get("backend", "quanto")
        if backend not in QUANTIZED_BACKENDS:
            raise ValueError(f"{where}.backend: must be one of {sorted(QUANTIZED_BACKENDS)}, got {backend!r}.")
    return out


_DUMMY_CONFIG = None


def _dummy_config():
    global _DUMMY_CONFIG
    if _DUMMY_CONFIG is None:
        from transformers import LlamaConfig

        # head_dim 128: divisible by the usual quantization group sizes (checks that depend on the real model's
        # shape run again when the cache is built for it)
        _DUMMY_CONFIG = LlamaConfig(
            vocab_size=32,
            hidden_size=256,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
        )
    return _DUMMY_CONFIG


def _build(config_or_model, name: str, cfg: dict, default_len: int | None):
    from transformers import PreTrainedModel

    model_config = config_or_model.config if isinstance(config_or_model, PreTrainedModel) else config_or_model
    if name in _ours():
        return _ours()[name].from_cache_config(config_or_model, cfg)
    from transformers import DynamicCache, QuantizedCache, StaticCache

    text_config = model_config.get_text_config(decoder=True)
    if name == "dynamic":
        return DynamicCache(config=text_config)
    if name == "offloaded":
        return DynamicCache(config=text_config, offloading=True)
    if name == "static":
        max_len = cfg.get("max_cache_len", default_len)
        if max_len is None:
            raise ValueError("cache 'static' needs `max_cache_len` (tokens, or a fraction of the context).")
        return StaticCache(config=text_config, max_cache_len=max_len)
    if name == "quantized":
        cfg = dict(cfg)
        backend = cfg.pop("backend", "quanto")
        module = QUANTIZED_BACKENDS[backend]
        if module is not None:
            import importlib.util

            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                extra = "quanto" if backend == "quanto" else "hqq"
                raise ValueError(
                    f"cache 'quantized' with backend {backend!r} needs the `{module}` package: "
                    f"pip install 'hf-kvcache[{extra}]' (or use backend 'fp8')."
                )
        return QuantizedCache(backend=backend, config=text_config, **cfg)
    raise AssertionError(name)


def check_cache(name: str, config: dict | None = None, context_len: int | None = None, where: str = "cache") -> dict:
    """Validate a cache spec without a model: resolves budgets, then builds the cache against a tiny config so the
    cache's own checks (e.g. sinks < budget) run. Returns the resolved config; raises ValueError naming `where`."""
    cfg = resolve_config(name, config, context_len, where)
    try:
        _build(_dummy_config(), name, cfg, default_len=context_len or 16)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: invalid config {cfg} for cache {name!r}: {err}") from err
    return cfg


def make_cache(model, name: str, config: dict | None = None, context_len: int | None = None, total_len=None):
    """Build the cache `name` for `model` (our caches get the model, so the attention bridge is enabled).
    `context_len` resolves budget fractions; `total_len` sizes a static cache (default: `context_len`)."""
    cfg = resolve_config(name, config, context_len)
    return _build(model, name, cfg, default_len=total_len or context_len)


def make_factory(model, spec: CacheSpec | tuple | str, context_len: int | None = None, total_len=None):
    """A zero-argument callable returning a fresh cache (what `stream_nll` and the scorers take)."""
    if isinstance(spec, str):
        spec = CacheSpec(spec)
    elif isinstance(spec, tuple):
        spec = CacheSpec(*spec)
    cfg = resolve_config(spec.name, spec.config, context_len)
    return lambda: _build(model, spec.name, cfg, default_len=total_len or context_len)
