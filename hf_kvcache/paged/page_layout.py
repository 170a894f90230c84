"""How the tokens a request keeps lie in continuous batching's pages: the `kv_compress_layout` field of the
continuous-batching config (`hf-kvcache serve --kv-layout`), validated. A property of the pages, so of the cache and
the server, not of a request."""

from __future__ import annotations

#: the continuous-batching config field (and `hf-kvcache serve --kv-layout`) saying how the kept tokens lie in the
#: pages: "token" (transformers' rows of every head: the same tokens in every head, as many in every layer) or "head"
#: (pages of one layer and KV head, each its own budget: hf_kvcache.paged.head_pages)
LAYOUT_FIELD = "kv_compress_layout"
LAYOUTS = ("token", "head")
DEFAULT_LAYOUT = "token"


def layout_of(cb_config) -> str:
    """The `kv_compress_layout` of a continuous-batching config (absent: DEFAULT_LAYOUT), validated."""
    layout = getattr(cb_config, LAYOUT_FIELD, None)
    if layout is None:
        return DEFAULT_LAYOUT
    if layout not in LAYOUTS:
        raise ValueError(f"`{LAYOUT_FIELD}` must be one of {LAYOUTS}, got {layout!r}.")
    return layout
