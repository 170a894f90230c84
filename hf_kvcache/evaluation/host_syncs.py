"""Count what would make an accelerator wait for the host, by running code on the CPU.

On a GPU, an operation whose result the Python program needs (`.item()`, `bool(t)`, `.tolist()`, a tensor used as
a Python index) or whose output shape depends on the data (`nonzero`, boolean-mask indexing, `masked_select`,
`unique`) blocks the host until the device has caught up. A decode step that does this once per layer cannot
overlap host and device work and cannot be captured in a CUDA graph. These operations have the same names on the
CPU, so they can be counted here without a GPU:

    with HostSyncCounter() as counter:
        model(**inputs, **cache_kwargs(cache))
    counter.syncs          # operations that force a host-device synchronisation
    counter.by_name        # which ones, e.g. {"aten._local_scalar_dense": 2}
    counter.ops            # every aten operation dispatched (a proxy for per-step launch overhead)

Python-level conversions are seen by a `TorchFunctionMode` (`tolist`, `numpy`), the rest at the aten level by a
`TorchDispatchMode` (`item`, `bool`, `int`, `__index__` end in `aten._local_scalar_dense`, or in `aten.item` /
`aten.is_nonzero` under `torch.inference_mode`; either way counted once: the mode is off while an op runs).
`torch._assert_async` is not counted: on an accelerator it checks on the device without waiting.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operations that read a value back to the host, or whose output shape depends on the data
SYNC_ATEN_OPS = (
    "aten._local_scalar_dense",
    "aten.item",  # under torch.inference_mode `.item()` / `__index__` arrive as this, not decomposed further
    "aten.is_nonzero",  # likewise `bool(t)` under inference_mode
    "aten.nonzero",
    "aten.nonzero_static",  # static size, but still reads the count back on some backends: counted to be safe
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.equal",
    "aten._assert_scalar",
)
#: Python-level tensor methods that copy data to the host
SYNC_PYTHON_METHODS = ("tolist", "numpy", "__array__")


def _aten_name(func) -> str:
    # e.g. aten.nonzero.default -> aten.nonzero
    name = str(func)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, owner: HostSyncCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_PYTHON_METHODS:
            self.owner._record(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: HostSyncCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _aten_name(func)
        self.owner.ops += 1
        self.owner.op_names[name] += 1
        if name in SYNC_ATEN_OPS:
            self.owner._record(name)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and _has_bool_index(args):
            self.owner._record(f"{name} (boolean mask)")
        elif name == "aten.repeat_interleave" and "output_size" not in (kwargs or {}) and _is_tensor_repeats(args):
            self.owner._record(f"{name} (tensor repeats)")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def _is_tensor_repeats(args) -> bool:
    return (len(args) > 1 and isinstance(args[1], torch.Tensor)) or len(args) == 1


class HostSyncCounter:
    """Context manager counting host-device synchronisations and aten operations (see the module docstring)."""

    def __init__(self):
        self.syncs = 0
        self.ops = 0
        self.by_name: Counter[str] = Counter()
        self.op_names: Counter[str] = Counter()
        self._modes = (_FunctionCounter(self), _DispatchCounter(self))

    def _record(self, name: str) -> None:
        self.syncs += 1
        self.by_name[name] += 1

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
