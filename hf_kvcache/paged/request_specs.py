"""The prompt-eviction settings requests named themselves (a server's `kv_compress` body field), by request id, for
the eviction of the continuous-batching manager that will run them (hf_kvcache.paged.eviction). Written by the
server's threads before a request is queued, read by the generation thread at the request's first forward."""

from __future__ import annotations

import threading

from .compress_spec import CompressSpec

#: guards the registries (the server's threads write, the generation thread reads)
LOCK = threading.Lock()

#: the continuous-batching config attribute naming the registry of specs requests asked for (request id -> spec or
#: None), filled by a server before the request is queued and read by the eviction of every cache built from that
#: config. A name, not the dict itself: transformers copies the config when it starts a manager.
REQUEST_SPECS_ATTR = "_hf_kvcache_request_specs"
_REGISTRIES: dict[str, dict] = {}


def request_specs(cb_config) -> dict:
    """The per-request specs of `cb_config` (an empty registry on first use)."""
    key = getattr(cb_config, REQUEST_SPECS_ATTR, None)
    if key is None:
        key = f"specs-{len(_REGISTRIES)}-{id(cb_config)}"
        setattr(cb_config, REQUEST_SPECS_ATTR, key)
    return _REGISTRIES.setdefault(key, {})


def set_request_spec(cb_config, request_id: str, spec: CompressSpec | None) -> None:
    """Before request `request_id` is queued on a manager built from `cb_config`: it keeps its prompt by `spec`
    (None: it is not compressed) instead of the config's `kv_compress`."""
    with LOCK:
        request_specs(cb_config)[request_id] = spec


def forget_request_spec(cb_config, request_id: str) -> None:
    """A request that was refused or cancelled before it started."""
    with LOCK:
        request_specs(cb_config).pop(request_id, None)
