"""What prompt eviction (hf_kvcache.paged.eviction) can run, checked before a run starts: the model's layers (full
attention only), the method (a scorer reading the queries, SnapKV, needs them after the cache's update; one reading the
attention inputs, KVzap, a surrogate trained for the model, loaded once here), and the method a spec that names none
runs for the model (`for_model`). Errors are ValueErrors naming `kv_compress`."""

from __future__ import annotations

import dataclasses

from ..integration.continuous_batching import BATCH_ATTENTION, EVICTION, FullAttentionCacheAllocator, update_caller
from ..integration.contracts import require
from .codes_attention import unreadable_pages
from .compress_spec import CHUNK, FIELD, LAYOUT_FIELD, CompressSpec
from .page_layout import default_layout
from .prompt_scores import reads

#: the method of a spec that names none, where a KVzap surrogate fits the model, and elsewhere: the most needle
#: answers through the server (docs/serving.md, eval/results/ruler_http; KVzap needs a surrogate trained for the model)
DEFAULT_METHODS = ("kvzap", "keydiff")


def default_method(spec: CompressSpec, config) -> str:
    """The method a spec naming none runs for a model of `config`: "kvzap" where a surrogate fits it (the spec's own,
    or the one shipped for the model), else "keydiff"."""
    from ..caches.kvzap import shipped_surrogate

    fits = spec.surrogate is not None or shipped_surrogate(config) is not None
    return DEFAULT_METHODS[0] if fits else DEFAULT_METHODS[1]


def default_chunk(method: str) -> int | None:
    """The `chunk` of a spec giving none: CHUNK where `method` scores each token once, as it arrives ("arrived":
    KVzap), so that compressing chunk by chunk keeps what the prompt's end would keep, the allotment and later tokens'
    view of the earlier ones apart (its needles measured: docs/serving.md); None, once at the prompt's end, for the
    others (keydiff's scores depend on the mean key, snapkv's on the last queries; knorm and sink_window unmeasured)."""
    return CHUNK if "arrived" in reads(method) else None


def for_model(spec: CompressSpec | None, config) -> CompressSpec | None:
    """`spec` with what it leaves to the model chosen: its method where it names none (`default_method`), then its
    chunk where it gives none (`default_chunk`); itself when nothing is left."""
    if spec is None:
        return spec
    method = spec.method or default_method(spec, config)
    chunk = default_chunk(method) if spec.chunk is None else spec.chunk
    if (method, chunk) == (spec.method, spec.chunk):
        return spec
    return dataclasses.replace(spec, method=method, chunk=chunk)


def unavailable(spec: CompressSpec, config) -> str | None:
    """Why `spec` cannot run for a model of `config` in continuous batching (None: it can)."""
    wanted = reads(spec.method)
    if "queries" in wanted:
        if update_caller() != "model attention":
            return (
                f"{spec.method} reads the queries the attention function gets after the cache's update "
                "(transformers >= 5.24)"
            )
        implementation = getattr(config, "_attn_implementation", None) or ""
        if "flash" in implementation:
            return (
                f"{spec.method} reads the queries through the {BATCH_ATTENTION} attention functions, not "
                f"{implementation!r}"
            )
    if "arrived" in wanted:
        try:
            surrogate_for(spec, config)
        except (ValueError, OSError) as error:
            return str(error)
    return None


_SURROGATES: dict[tuple, object] = {}


def surrogate_for(spec: CompressSpec, config):
    """KVzap's surrogate for `spec` and the model of `config` (loaded once per name and model; raises ValueError when
    none fits, e.g. no surrogate was given for a model without a shipped one)."""
    from ..caches.kvzap import _resolve_surrogate

    key = (spec.surrogate, getattr(config, "_name_or_path", None), config.num_hidden_layers)
    if key not in _SURROGATES:
        surrogate = _resolve_surrogate(spec.surrogate, config)
        missing = sorted(set(range(config.num_hidden_layers)) - set(surrogate.layers))
        if missing:
            raise ValueError(f"`{FIELD}.surrogate` has no predictor for layers {missing}; every layer is compressed.")
        _SURROGATES[key] = surrogate
    return _SURROGATES[key]


def _refuse_layer_types(others) -> None:
    if others:
        raise ValueError(
            f"`{FIELD}`: this model has {sorted(set(others))} layers, whose pages eviction does not compact yet; only "
            "models whose layers all use full attention can compress their prompts in continuous batching."
        )


def check_model(spec: CompressSpec | None, config, layout: str | None = None) -> None:
    """Raise ValueError naming `kv_compress` when a model of `config` cannot run `spec` (its method chosen for the
    model, `for_model`) on pages laid out by `layout` (None: the default) before a run starts."""
    require(EVICTION)
    spec, layout = for_model(spec, config), layout or default_layout()
    if layout == "head" and (reason := unreadable_pages()) is not None:
        raise ValueError(f"`{LAYOUT_FIELD}` 'head' cannot run here: {reason} (attention must read the head pages).")
    if spec is not None:
        spec.check_layout(layout)
    _refuse_layer_types([t for t in getattr(config, "layer_types", None) or () if t != "full_attention"])
    if spec is not None and (reason := unavailable(spec, config)) is not None:
        raise ValueError(f"`{FIELD}.method` {spec.method!r} cannot run here: {reason}.")


def layout_of(cache_allocators: dict) -> str:
    """ "head" for pages of one (layer, head) (hf_kvcache.paged.head_pages), else "token"."""
    from .head_pages import HeadPagedAllocator

    return "head" if any(isinstance(a, HeadPagedAllocator) for a in cache_allocators.values()) else "token"


def check(spec: CompressSpec | None, config, cache_allocators: dict) -> None:
    """Raise ValueError naming `kv_compress` when `spec` cannot run on this cache (see the module docstring)."""
    _refuse_layer_types(
        [name for name, a in cache_allocators.items() if not isinstance(a, FullAttentionCacheAllocator)]
    )
    spec = for_model(spec, config)
    if spec is None:
        return
    spec.check_layout(layout_of(cache_allocators))
    reason = unavailable(spec, config)
    if reason is not None:
        raise ValueError(f"`{FIELD}.method` {spec.method!r} cannot run here: {reason}.")
