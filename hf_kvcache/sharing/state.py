"""Save a cache's state to one file and load it back: pause a stream, resume it later (in another process) with
identical results.

`save_cache_state(cache, path)` writes one safetensors file: every tensor the cache's layers hold (slot buffers,
quantized codes and scales, slot positions and validity, policy state such as H2O scores or sink keys) as
safetensors tensors, and, as JSON in the file's header metadata (key `"hf_kvcache"`), everything else:
- `format` / `format_version` (this module reads version `FORMAT_VERSION`) and the `hf_kvcache_version` that wrote it,
- `cache` (the registered name) and `settings` / `layers_setting` (the constructor's arguments, as given: see
  `KVCache.__new__`),
- `model`: the shape of the model the cache belongs to (model type, layers, heads, head size, layer types),
- `state`: the attribute tree of each layer (ours and transformers' own), with Python numbers, strings, dtypes and
  devices by name, containers spelled out, and tensors by their key in the file; plus the stream's sticky
  `ForwardInfo.has_padding`.
No pickle, nothing executable: loading builds a fresh cache from the settings with the caller's model or config
(checked against `model`, field by field) and writes the saved values into the attributes it has (an attribute
tree that disagrees with the fresh cache's, e.g. a file from another cache layout, is an error naming the path).

What is not state, and therefore not saved: per-forward bookkeeping (`ForwardInfo` of the current forward, the
columns of the last update, dequantization workspaces, cached casts), and objects the constructor rebuilds from
the settings and the model (RoPE rotators, quantization specs, tensor-parallel groups, backend functions).
A cache can be saved between forwards only (not while a chunk waits for its attention scores).

`load_cache_state(path, config_or_model, cache=None, device=None)`: `cache` (a name or class) makes a file of
another cache an error; `device` maps every tensor there (default: CPU).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from ..caches.base import KVCache
from ..common.architecture import attention_head_dim, kv_head_count, layer_plan
from ..common.compile_static import static_values
from ..integration.cache_layers import DERIVED_FIELDS, is_upstream_layer_object, restore_derived, upstream_layer
from ..layers.forward_info import ForwardInfo

FORMAT = "hf_kvcache.cache_state"
FORMAT_VERSION = 1
METADATA_KEY = "hf_kvcache"

#: attributes that are per-forward bookkeeping or references to shared helpers, never state
_TRANSIENT = frozenset(
    {
        "forward_info",
        "_served_forward",
        "_attended_forward",
        "_attention_columns",
        "_attention_query_len",
        "codes_read",
        "_key_mean_cast",
        "kernel_view",  # the native kernel's view of a layer's store (codes_read.KernelView), remade from the buffers
        "_moved",
        "_moved_key",
        "workspace",
        "rotator",
        "tensor_parallel",
        "_signed_freq",  # SinkMemory's RoPE frequencies in files from before they moved to the rotator (not saved)
        "_static_values",  # the holder of StaticInt values, saved as the owner's own fields (static_values)
    }
)
_SCALARS = (type(None), bool, int, float, str)


def _rebuilt_types() -> tuple[type, ...]:
    """Objects the constructor rebuilds from the settings and the model: skipped, wherever they are referenced."""
    from ..common.rope import KeyRotator
    from ..common.tensor_parallel import TensorParallel
    from ..layers.slot_view import LayerSlotView
    from ..stores.quantization import QuantSpec
    from ..stores.workspace import DequantWorkspace, TransientWorkspace

    return (
        KeyRotator,
        QuantSpec,
        DequantWorkspace,
        TransientWorkspace,
        TensorParallel,
        ForwardInfo,
        LayerSlotView,
        PretrainedConfig,
        torch.nn.Module,
        torch.Generator,
    )


def _state_class(obj) -> bool:
    """Objects whose attributes are walked: our layers, policies, stores and codecs, and transformers' cache layers."""
    return hasattr(obj, "__dict__") and (
        type(obj).__module__.startswith("hf_kvcache.") or is_upstream_layer_object(obj)
    )


def _skipped(obj, name: str) -> bool:
    """Fields never saved: per-forward bookkeeping, and what a transformers layer derives from its tensors (which
    differs by transformers version: hf_kvcache.integration.cache_layers)."""
    return name in _TRANSIENT or (name in DERIVED_FIELDS and is_upstream_layer_object(obj))


class _Encoder:
    """Attribute trees -> JSON-able values, tensors collected by key (each tensor object once: aliases by key)."""

    def __init__(self, prefix: str = ""):
        self.tensors: dict[str, torch.Tensor] = {}
        self._tensor_keys: dict[int, str] = {}
        self._objects: dict[int, str] = {}
        self._skip = _rebuilt_types()

    def encode(self, value, path: str):
        if isinstance(value, torch.Tensor):
            key = self._tensor_keys.get(id(value))
            if key is None:
                key = self._tensor_keys[id(value)] = path
                self.tensors[key] = value.detach().contiguous().clone()  # own storage: safetensors refuses shared
            return {"tensor": key}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, (list, tuple)):
            items = [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]
            return {"list" if isinstance(value, list) else "tuple": items}
        if isinstance(value, (set, frozenset)):
            if not all(isinstance(v, _SCALARS) for v in value):
                raise ValueError(f"save_cache_state: `{path}` is a set of non-scalar values; cannot save it.")
            return {"set": sorted(value, key=repr)}
        if isinstance(value, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
                raise ValueError(f"save_cache_state: `{path}` is a dict with keys other than str/int; cannot save it.")
            return {"dict": [[k, self.encode(v, f"{path}.{k}")] for k, v in value.items()]}
        if _state_class(value):
            if id(value) in self._objects:
                return {"alias": self._objects[id(value)]}
            self._objects[id(value)] = path
            fields = {}
            for name, field in {**vars(value), **static_values(value)}.items():
                if _skipped(value, name) or isinstance(field, self._skip) or _is_code(field):
                    continue
                if name == "_pending" and field is not None:
                    raise ValueError(
                        f"save_cache_state: `{path}` holds a chunk waiting for its attention scores (saved in the "
                        "middle of a forward); save between forwards."
                    )
                fields[name] = self.encode(field, f"{path}.{name}")
            return {"object": f"{type(value).__module__}.{type(value).__qualname__}", "fields": fields}
        raise ValueError(
            f"save_cache_state: `{path}` is a {type(value).__module__}.{type(value).__qualname__}, which a cache "
            "state file cannot hold (tensors, numbers, strings, dtypes, devices, containers of them)."
        )


def _is_code(value) -> bool:
    return callable(value) and not isinstance(value, torch.Tensor) and not _state_class(value)


#: modules of hf_kvcache 0.1 that 0.2 moved (packages by role): class names in files written before the move
_MOVED_MODULES = {
    "hf_kvcache.layer": "hf_kvcache.layers.layer",
    "hf_kvcache.forward_info": "hf_kvcache.layers.forward_info",
    "hf_kvcache.rope": "hf_kvcache.common.rope",
    "hf_kvcache.tensor_parallel": "hf_kvcache.common.tensor_parallel",
    "hf_kvcache.compile_static": "hf_kvcache.common.compile_static",
    "hf_kvcache.caches": "hf_kvcache.caches.base",
    "hf_kvcache.composite": "hf_kvcache.caches.composite",
    "hf_kvcache.quantized": "hf_kvcache.caches.quantized",
    "hf_kvcache.scorer_caches": "hf_kvcache.caches.scorers",
}


def _composite_policy_before_scorers(fields: dict) -> dict:
    """The composite's policy before hf_kvcache.scorers (0.3.0, `policies.cascade.CascadePolicy`): the scorer object
    was `heavy_scorer`, `scorer` its name, and
    what the bridge reads was copied from it (now read from the scorer)."""
    if "heavy_scorer" not in fields:  # written since
        return fields
    copied = ("scorer", "deferred", "needs_attention", "needs_queries", "reads_stored_keys", "attention_window")
    fields = {k: v for k, v in fields.items() if k not in copied}
    fields["scorer"] = fields.pop("heavy_scorer")
    return fields


def _h2o_scorer_before_scorers(fields: dict) -> dict:
    """cascade_scorers.H2OScorer held a HeavyHitterPolicy for its `aggregate`; the scorer holds the name."""
    aggregation = fields.get("aggregation")
    if isinstance(aggregation, dict) and "object" in aggregation:
        aggregation = aggregation.get("fields", {}).get("aggregation", "sum")
    return {"aggregation": aggregation if isinstance(aggregation, str) else "sum"}


#: objects of files written before hf_kvcache.scorers: class name -> (class name now, fields -> fields now)
_UPGRADED_OBJECTS = {
    "hf_kvcache.policies.cascade.CascadePolicy": (
        "hf_kvcache.policies.composite.CompositePolicy",
        _composite_policy_before_scorers,
    ),
    "hf_kvcache.policies.cascade_scorers.H2OScorer": ("hf_kvcache.scorers.h2o.H2O", _h2o_scorer_before_scorers),
    # the KVzip scorer was called after what it reads (`Reconstruction`); scorers are named after their method
    "hf_kvcache.scorers.kvzip.Reconstruction": ("hf_kvcache.scorers.kvzip.KVzip", dict),
    # the aggregation moved to the H2O scorer (which the settings rebuild): a string here is from before
    "hf_kvcache.policies.heavy_hitter.HeavyHitterPolicy": (
        "hf_kvcache.policies.heavy_hitter.HeavyHitterPolicy",
        lambda fields: {k: v for k, v in fields.items() if not (k == "aggregation" and isinstance(v, str))},
    ),
}


def _upgraded(enc: dict) -> dict:
    """An object entry of an older file in today's terms (`_UPGRADED_OBJECTS`); others as they are."""
    upgrade = _UPGRADED_OBJECTS.get(str(enc["object"]))
    if upgrade is None:
        return enc
    name, fields = upgrade
    return {"object": name, "fields": fields(dict(enc.get("fields", {})))}


def _current_name(saved: str) -> str:
    """A class name from a file, with the module it lives in now."""
    module, _, qualname = str(saved).rpartition(".")
    return f"{_MOVED_MODULES.get(module, module)}.{qualname}"


class _Decoder:
    """JSON values + loaded tensors -> values written into a fresh cache's attribute tree."""

    def __init__(self, tensors: dict[str, torch.Tensor], device, where: str):
        self.tensors, self.device, self.where = tensors, device, where

    def error(self, path: str, problem: str) -> ValueError:
        return ValueError(f"{self.where}: field `state.{path}`: {problem}")

    def value(self, enc, current, path: str):
        if isinstance(enc, _SCALARS):
            return enc
        if not isinstance(enc, dict) or len(enc) not in (1, 2):
            raise self.error(path, f"malformed entry {str(enc)[:80]!r}.")
        if "tensor" in enc:
            if enc["tensor"] not in self.tensors:
                raise self.error(path, f"names tensor {enc['tensor']!r}, which the file does not hold.")
            return self.tensors[enc["tensor"]]
        if "dtype" in enc:
            dtype = getattr(torch, str(enc["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise self.error(path, f"unknown dtype {enc['dtype']!r}.")
            return dtype
        if "device" in enc:
            return torch.device(self.device)
        if "list" in enc or "tuple" in enc:
            items = enc.get("list", enc.get("tuple"))
            old = current if isinstance(current, (list, tuple)) and len(current) == len(items) else [None] * len(items)
            values = [self.value(e, c, f"{path}.{i}") for i, (e, c) in enumerate(zip(items, old))]
            return values if "list" in enc else tuple(values)
        if "set" in enc:
            return set(enc["set"])
        if "dict" in enc:
            old = current if isinstance(current, dict) else {}
            return {k: self.value(e, old.get(k), f"{path}.{k}") for k, e in enc["dict"]}
        if "alias" in enc:  # the same object as at another path: the fresh cache links them itself
            return current
        if "object" in enc:
            enc = _upgraded(enc)
            name = f"{type(current).__module__}.{type(current).__qualname__}"
            if current is None or name != _current_name(enc["object"]):
                raise self.error(
                    path,
                    f"the file holds a {enc['object']} here, this cache a {name}: the file is "
                    "from another cache layout or version.",
                )
            self.fill(current, enc.get("fields", {}), path)
            return current
        raise self.error(path, f"malformed entry {str(enc)[:80]!r}.")

    def fill(self, obj, fields: dict, path: str) -> None:
        known = {**vars(obj), **static_values(obj)}
        for name, enc in fields.items():
            if _skipped(obj, name):  # e.g. `dtype` of a transformers layer in a file written before 5.24
                continue
            current = known.get(name)
            setattr(obj, name, self.value(enc, current, f"{path}.{name}"))
        if is_upstream_layer_object(obj):
            restore_derived(obj)


def _model_shape(config) -> dict[str, Any]:
    """The facts of the model a cache state depends on (compared field by field when loading)."""
    config = config.get_text_config(decoder=True)
    return {
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": kv_head_count(config),
        "head_dim": attention_head_dim(config),
        "layer_types": layer_plan(config)[0],
    }


#: the revision of the caches' defaults a file's settings assume (its `defaults` field; absent: 1). Settings are the
#: arguments as given, so a file of an older revision gets the defaults it was written under back for the arguments
#: it did not give.
DEFAULTS_REVISION = 2
#: revision -> {cache name: the defaults that revision had and the next one changed}
DEFAULTS_BEFORE = {
    # issue 48: the best measured settings became the defaults (docs/defaults.md)
    1: {
        "h2o": {"attention_score": "accumulated"},
        "kvzip": {"head_budget": "uniform", "layer_budget": "uniform"},
    },
}


def _settings_as_written(name: str, settings: dict, revision: int) -> dict:
    """`settings` with the defaults of the revision the file was written under, for the arguments it did not give."""
    settings = dict(settings)
    for old in range(revision, DEFAULTS_REVISION):
        for key, value in DEFAULTS_BEFORE.get(old, {}).get(name, {}).items():
            settings.setdefault(key, value)
    return settings


def save_cache_state(cache: KVCache, path: str | os.PathLike) -> None:
    """Write `cache`'s settings and state to the safetensors file `path` (see the module docstring)."""
    if not isinstance(cache, KVCache):
        raise ValueError(
            f"save_cache_state: `cache` must be an hf_kvcache cache (a KVCache), got {type(cache).__name__}."
        )
    settings = _Encoder()
    given = settings.encode(dict(cache._given), "settings")
    layers_setting = settings.encode(getattr(cache, "_given_layers", None), "layers_setting")
    state = _Encoder()
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "hf_kvcache_version": _version(),
        "defaults": DEFAULTS_REVISION,
        "cache": type(cache).cache_name,
        "class": type(cache).__name__,
        "settings": given,
        "layers_setting": layers_setting,
        "model": _model_shape(cache.config),
        "state": {
            "cache": cache.state_phase(),  # what the cache's own layer set is in (KVzip: its context placed)
            "layers": state.encode(list(cache.layers), "layers"),
            "forward_info": {"has_padding": cache.forward_info.has_padding},
        },
    }
    clash = set(settings.tensors) & set(state.tensors)
    assert not clash, clash  # different prefixes ("settings", "layers_setting" vs "layers")
    save_file({**settings.tensors, **state.tensors}, os.fspath(path), metadata={METADATA_KEY: json.dumps(header)})


def _version() -> str:
    from ..version import __version__

    return __version__


def read_cache_state_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a cache state file (settings, model shape, format version), checked to be one."""
    where = f"cache state file {os.fspath(path)!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist.")
    try:
        with safe_open(os.fspath(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{where} is not a readable safetensors file (truncated or another format?): {err}") from None
    if METADATA_KEY not in metadata:
        raise ValueError(
            f"{where} is a safetensors file without the {METADATA_KEY!r} header: not written by "
            "hf_kvcache.save_cache_state."
        )
    try:
        header = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: its {METADATA_KEY!r} header is not valid JSON ({err}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: its {METADATA_KEY!r} header must be a JSON object, got {type(header).__name__}.")
    for field in ("format", "format_version", "cache", "settings", "layers_setting", "model", "state"):
        if field not in header:
            raise ValueError(f"{where}: field `{field}` is missing from its header.")
    if header["format"] != FORMAT:
        raise ValueError(f"{where}: field `format` is {header['format']!r}, expected {FORMAT!r}.")
    if header["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{where}: field `format_version` is {header['format_version']!r} (written by hf_kvcache "
            f"{header.get('hf_kvcache_version', '?')}); this hf_kvcache ({_version()}) reads version {FORMAT_VERSION}."
        )
    return header


def _windows_as_saved(cache: KVCache, saved_layers) -> None:
    """Sliding / chunked layers built as the file holds them: DynamicCache's in a file written before such layers of
    fixed-capacity caches became StaticCache's (`upstream_layer`), so those files still resume (not compileable, as
    when they were written)."""
    saved = saved_layers.get("list") if isinstance(saved_layers, dict) else None
    if not isinstance(saved, list) or len(saved) != len(cache.layers):
        return  # (the decoder names what is wrong)
    layer_types, layer_kwargs = layer_plan(cache.config)
    for i, (enc, layer_type, kwargs) in enumerate(zip(saved, layer_types, layer_kwargs)):
        name = enc.get("object") if isinstance(enc, dict) else None
        if name is None or not is_upstream_layer_object(cache.layers[i]):
            continue
        for static in (False, True):
            candidate = upstream_layer(layer_type, kwargs, static)
            if f"{type(candidate).__module__}.{type(candidate).__qualname__}" == name:
                cache.layers[i] = candidate
                break


def load_cache_state(
    path: str | os.PathLike, config_or_model, cache: str | type | None = None, device: str | torch.device | None = None
) -> KVCache:
    """A cache built from the settings in `path` for `config_or_model` (a model enables the attention bridge, as the
    constructors do), holding the saved state: the stream resumes where `save_cache_state` left it."""
    from ..caches.catalog import CACHE_IMPLEMENTATIONS

    header = read_cache_state_header(path)
    where = f"cache state file {os.fspath(path)!r}"
    name = header["cache"]
    if name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"{where}: field `cache` is {name!r}, not one of {sorted(CACHE_IMPLEMENTATIONS)}.")
    if cache is not None:
        expected = cache if isinstance(cache, str) else getattr(cache, "cache_name", None)
        if expected not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"load_cache_state: `cache` must be one of {sorted(CACHE_IMPLEMENTATIONS)} or its class, got {cache!r}."
            )
        if expected != name:
            raise ValueError(f"{where}: field `cache` is {name!r}, but {expected!r} was asked for.")
    config = config_or_model.config if isinstance(config_or_model, PreTrainedModel) else config_or_model
    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"load_cache_state: `config_or_model` must be a transformers model or its config, got "
            f"{type(config_or_model).__name__}."
        )
    shape, saved_shape = _model_shape(config), header["model"]
    for field, value in shape.items():
        if saved_shape.get(field) != value:
            raise ValueError(
                f"{where}: field `model.{field}` is {saved_shape.get(field)!r} in the file, but "
                f"{value!r} for the given model: the state belongs to another model shape."
            )
    device = torch.device("cpu" if device is None else device)
    try:
        tensors = load_file(os.fspath(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{where}: its tensors cannot be read (truncated?): {err}") from None
    decoder = _Decoder(tensors, device, where)
    settings = decoder.value(header["settings"], None, "settings")
    layers_setting = decoder.value(header["layers_setting"], None, "layers_setting")
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: field `settings` must be a mapping of constructor arguments.")
    revision = header.get("defaults", 1)
    if not isinstance(revision, int) or not 1 <= revision <= DEFAULTS_REVISION:
        raise ValueError(f"{where}: field `defaults` must be a revision in [1, {DEFAULTS_REVISION}], got {revision!r}.")
    settings = _settings_as_written(name, settings, revision)
    restored = CACHE_IMPLEMENTATIONS[name](config_or_model, **settings, layers=layers_setting)
    state = header["state"]
    if not isinstance(state, dict) or "layers" not in state:
        raise ValueError(f"{where}: field `state.layers` is missing.")
    restored.enter_state_phase(state.get("cache") or {}, where)
    _windows_as_saved(restored, state["layers"])
    layers = decoder.value(state["layers"], list(restored.layers), "layers")
    if len(layers) != len(restored.layers):
        raise ValueError(
            f"{where}: field `state.layers` holds {len(layers)} layers, this cache {len(restored.layers)}."
        )
    restored.forward_info.has_padding = bool(state.get("forward_info", {}).get("has_padding", False))
    return restored
