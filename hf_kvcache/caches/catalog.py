"""The catalog of cache names: `cache_implementation` name -> class.

Filled by hf_kvcache.caches.registry with the built-in presets (and by `hf_kvcache.register(name, cls)` with a
user's own); it lives apart so that the base class can switch a layer to another named cache (`layers={i:
{"cache": NAME}}`) without importing the presets built on it.
"""

from __future__ import annotations

CACHE_IMPLEMENTATIONS: dict[str, type] = {}
