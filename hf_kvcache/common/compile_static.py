"""What torch.compile may treat as fixed for a cache's life: its sizes (budget, regions, windows) and the shapes of
the buffers they size.

Dynamo's default ("automatic dynamic") compiles the first value of every Python int and every tensor size as a
constant, and once one of them changes between two compilations of the same function, it recompiles with that value
symbolic. That suits the per-step counters (`seen`: symbolic after the warm-up, so decode never recompiles), but a
second cache of another budget through the same compiled forward (generate keeps its compiled forward on the model; a
sweep of budgets in one process) turns the budget and every buffer it sizes symbolic too. Inductor then writes
generic index arithmetic (divisions and modulos by the symbolic sizes, nothing vectorised) for the kernels that read
those buffers: measured on SmolLM2's shapes (CPU), the composite's compiled decode went from ~2 ms to ~45 ms per layer
at budget 1024 after one at 256. So:

- `StaticInt`: a class attribute declaring an int (or a tuple of ints) that is fixed for the object's life. Its value
  lives on a small `torch.nn.Module` beside the object, because dynamo specialises the int attributes of modules
  (`torch._dynamo.config.allow_unspec_int_on_nn_module`, off by default): a new value means one more compiled graph,
  never a symbolic size.
- `fixed_shape`: marks a buffer allocated once for the cache's life (slots, per-slot state, the dequantization
  workspace) as static in every dim (`torch._dynamo.mark_static`), for the same reason.

The cost: one graph per cache configuration (plus the warm-up ones), so a process compiling more than a few budgets
needs `torch._dynamo.config.recompile_limit` raised, as for any shape-specialised compiled model."""

from __future__ import annotations

import torch


class _StaticValues(torch.nn.Module):
    """Holder of an object's StaticInt values (a module only so that dynamo specialises them)."""


class StaticInt:
    """`capacity = StaticInt()` in a class body: `obj.capacity` reads and writes an int (or a tuple of ints, or None)
    that torch.compile specialises on. Lists are stored as tuples (a tuple cannot change behind the holder's back)."""

    def __init__(self, default=None):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        holder = obj.__dict__.get("_static_values")
        return self.default if holder is None else holder.__dict__.get(self.name, self.default)

    def __set__(self, obj, value) -> None:
        holder = obj.__dict__.get("_static_values")
        if holder is None:
            holder = obj.__dict__["_static_values"] = _StaticValues()
        holder.__dict__[self.name] = tuple(value) if isinstance(value, list) else value


class StaticField(StaticInt):
    """A StaticInt that is a dataclass field: `window: int = StaticField(64)` (a parameter of a scorer that sizes its
    buffers). Dataclasses read a field's default through the class, so the class gives the default."""

    def __get__(self, obj, owner=None):
        return self.default if obj is None else super().__get__(obj, owner)


def static_values(obj) -> dict:
    """The StaticInt values `obj` holds, by attribute name (for code that walks objects' attributes: state files):
    those of the StaticInt attributes its class declares (the holder module's own attributes are not among them)."""
    holder = vars(obj).get("_static_values")
    if holder is None:
        return {}
    declared = {
        name for klass in type(obj).__mro__ for name, attr in vars(klass).items() if isinstance(attr, StaticInt)
    }
    return {name: value for name, value in vars(holder).items() if name in declared}


def fixed_shape(*tensors: torch.Tensor) -> None:
    """Mark buffers that keep their shape for the cache's life as static in every dim (eager code only: the
    marks are read when dynamo meets the buffers as inputs of a compiled step)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None and t.dim() > 0:
            torch._dynamo.mark_static(t)
