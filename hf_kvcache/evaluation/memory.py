"""Bytes actually held by a cache: ours report it themselves; for any other transformers cache we walk its layers'
tensors (quantized tensor subclasses included, via their inner tensors), counting each storage once."""

from __future__ import annotations

import torch


def _tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    if depth > 6 or obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen, depth + 1) for n in names)
        if obj.device.type == "meta":
            return 0
        key = (obj.untyped_storage().data_ptr(), obj.device)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def cache_nbytes(cache) -> int:
    """Bytes held by `cache`: `cache.nbytes()` when it has one (ours), else the sum of its layers' tensor storages."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    seen: set = set()
    return sum(_tensor_bytes(layer, seen) for layer in getattr(cache, "layers", []))
