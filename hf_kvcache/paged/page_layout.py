"""How the tokens a request keeps lie in continuous batching's pages: the `kv_compress_layout` field of the
continuous-batching config (`hf-kvcache serve --kv-layout`), validated. A property of the pages, so of the cache and
the server, not of a request.

The default is "head" wherever attention can read head pages (transformers >= 5.24: its attention functions no
longer update paged caches themselves), because per-(layer, head) budgets keep what `generate`'s KVzip and KVzap keep
(docs/serving.md: the needle table through the server); on transformers 5.23 it is "token", the one layout that runs
there. Given explicitly, a layout that cannot run is an error naming the field."""

from __future__ import annotations

#: the continuous-batching config field (and `hf-kvcache serve --kv-layout`) saying how the kept tokens lie in the
#: pages: "token" (transformers' rows of every head: the same tokens in every head, as many in every layer) or "head"
#: (pages of one layer and KV head, each its own budget: hf_kvcache.paged.head_pages)
LAYOUT_FIELD = "kv_compress_layout"
LAYOUTS = ("token", "head")
#: the layout where the field is absent and head pages can run (see `default_layout`)
DEFAULT_LAYOUT = "head"


def default_layout() -> str:
    """DEFAULT_LAYOUT ("head") where attention can read head pages on this transformers, else "token"."""
    from .codes_attention import unreadable_pages

    return DEFAULT_LAYOUT if unreadable_pages() is None else "token"


def layout_of(cb_config) -> str:
    """The `kv_compress_layout` of a continuous-batching config (absent: `default_layout()`), validated."""
    layout = getattr(cb_config, LAYOUT_FIELD, None)
    if layout is None:
        return default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"`{LAYOUT_FIELD}` must be one of {LAYOUTS}, got {layout!r}.")
    return layout
