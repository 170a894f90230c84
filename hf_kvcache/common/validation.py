"""Validation of user-facing parameters: every bad value gets a ValueError naming the parameter and what is allowed."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


def require_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return `value` as an int, or raise: bools, floats and strings are not silently converted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return int(value)


def require_choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")
    return value


def check_keys(what: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """Unknown keys are an error, never ignored: a typo in a published config must not change nothing silently."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"Unknown {what} key(s) {unknown}; valid keys are {sorted(valid)}.")
