"""Strict JSON for configs that travel (kvcache_config.json, generation_config.json's key): plain values only, no
duplicate keys, no NaN / Infinity, every problem a ValueError naming the file or field."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def check_json_value(value: Any, where: str) -> None:
    """Raise ValueError unless `value` is plain JSON (dict with str keys, list, str, finite number, bool, None)."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} is not a finite number (JSON has no NaN or Infinity).")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} must be a string (JSON object keys are strings).")
            check_json_value(item, f"{where}[{key!r}]")
        return
    raise ValueError(
        f"{where}: {value!r} ({type(value).__name__}) is not a JSON value; allowed are dict, list, str, int, float, "
        f"bool and None."
    )


def _no_duplicates(source: str):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{source}: key {key!r} appears twice in the same JSON object.")
            seen[key] = value
        return seen

    return hook


def _no_constants(source: str):
    def hook(name):
        raise ValueError(f"{source}: {name} is not valid JSON (JSON has no NaN or Infinity).")

    return hook


def read_json_file(path: str | os.PathLike) -> Any:
    """Parse a JSON file strictly; every problem raises ValueError naming the file (OSError if it cannot be read)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not a JSON text file (not UTF-8: byte {error.start} is {raw[error.start]:#04x}); expected a "
            f'JSON object like {{"cache": "sink", "config": {{...}}}}.'
        ) from None
    if not text.strip():
        raise ValueError(f'{path} is empty; expected a JSON object like {{"cache": "sink", "config": {{...}}}}.')
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(path), parse_constant=_no_constants(path))
    except json.JSONDecodeError as error:
        end = error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
        what = "truncated (the JSON ends early)" if end else "not valid JSON"
        raise ValueError(f"{path} is {what}: {error.msg} at line {error.lineno}, column {error.colno}.") from None
