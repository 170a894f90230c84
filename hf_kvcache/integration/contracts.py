"""Every assumption hf_kvcache makes about transformers internals, each written once as a named, checkable contract.

A contract is a function that inspects the installed transformers (signatures, module attributes, class attributes;
source text only where nothing else shows the behaviour) and returns None when the assumption holds, or a sentence
saying what changed. `require(name)` runs it (once per process, cached) and raises `UnsupportedTransformersError`
with the installed version, the tested range and that sentence; features call it before they patch or rely on the
internal, so a broken contract fails loudly where it is used. `tests/test_upstream_contracts.py` runs every
contract on the installed version (`make test-latest` on the newest release, CI on both ends of the range).

Tests fake a broken contract with `broken(name, reason)` (a context manager), and check the feature raises.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from .versions import UnsupportedTransformersError, describe


@dataclass(frozen=True)
class Contract:
    name: str  # the internal relied on, e.g. "GenerationMixin._prepare_cache_for_generation"
    what: str  # what hf_kvcache assumes of it (one sentence)
    used_by: str  # the feature that needs it, e.g. "generate(cache_implementation=NAME)"
    check: Callable[[], str | None]  # None when it holds, else what changed


CONTRACTS: dict[str, Contract] = {}
_results: dict[str, str | None] = {}
_forced: dict[str, str] = {}


def contract(name: str, what: str, used_by: str):
    """Decorator registering `check` (no arguments; None = holds, else what changed) as the contract `name`."""

    def register(check: Callable[[], str | None]):
        if name in CONTRACTS:
            raise RuntimeError(f"contract {name!r} is defined twice")
        CONTRACTS[name] = Contract(name, what, used_by, check)
        return check

    return register


def problem(name: str) -> str | None:
    """What changed in the internal `name` on the installed transformers, or None when the contract holds."""
    if name in _forced:
        return _forced[name]
    if name not in _results:
        try:
            _results[name] = CONTRACTS[name].check()
        except Exception as error:  # an internal that moved so far the check itself fails
            _results[name] = f"the check failed: {type(error).__name__}: {error}"
    return _results[name]


def holds(name: str) -> bool:
    return problem(name) is None


def error_for(name: str) -> UnsupportedTransformersError:
    entry = CONTRACTS[name]
    return UnsupportedTransformersError(
        f"{entry.used_by} relies on the transformers internal `{entry.name}` ({entry.what}), which changed in "
        f"{describe()}: {problem(name)}."
    )


def require(*names: str) -> None:
    """Raise `UnsupportedTransformersError` for the first of `names` whose contract does not hold."""
    for name in names:
        if problem(name) is not None:
            raise error_for(name)


@contextlib.contextmanager
def broken(name: str, reason: str = "faked by a test"):
    """Make contract `name` fail inside the block (tests of the error paths)."""
    if name not in CONTRACTS:
        raise KeyError(f"no contract {name!r}; contracts: {sorted(CONTRACTS)}")
    _forced[name] = reason
    try:
        yield
    finally:
        _forced.pop(name, None)


def markdown_table() -> str:
    """The contracts as a markdown table (docs/upstream_contracts.md holds it; a test keeps the page current)."""
    rows = ["| internal | what hf_kvcache assumes | needed by |", "|---|---|---|"]
    rows += [f"| `{c.name}` | {c.what} | {c.used_by} |" for c in sorted(CONTRACTS.values(), key=lambda c: c.name)]
    return "\n".join(rows)


# -- helpers for the checks ------------------------------------------------------------------------------------


def parameters(fn) -> list[str]:
    """Parameter names of `fn` as declared (decorators that use functools.wraps are looked through). Remembered
    per function object (`cache_kwargs` asks at every call, and inspect.signature takes ~90 us; a function patched
    in, as tests do, is another object)."""
    try:
        return list(_signature_names(fn))
    except TypeError:  # (an unhashable callable)
        return list(inspect.signature(fn).parameters)


@functools.lru_cache(maxsize=512)
def _signature_names(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def source(fn) -> str:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def missing_parameters(fn, expected: list[str], label: str) -> str | None:
    have = parameters(fn)
    if have[: len(expected)] != expected:
        return f"{label} takes {have}, expected {expected} first"
    return None
