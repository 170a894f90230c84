"""Argument types of the `hf-kvcache` command line: numbers, lists, needle positions and cache specs. Each refuses
bad text with a message that says what is valid (argparse prints it next to the option's name)."""

from __future__ import annotations

import argparse
import json

# the --model and --text help of the evaluation commands (serve takes more: its own)
MODEL_HELP = "Hub id, local path, or an offline model: 'smollm2' (default) or 'gemma3'"
TEXT_HELP = "'pydoc' (offline corpus; default), a text file, or hf:DATASET"


def _number(parse, valid, wanted: str):
    """An argparse type: `parse` (int or float) the text, then require `valid(value)`; else "expected `wanted`, got
    ..." (the text as typed, or the integer it parsed to)."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not valid(value):
            got = value if parse is int else repr(text)
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {got}")
        return value

    return convert


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers; a ValueError naming `flag` otherwise."""
    try:
        return [positive_int(t) for t in text.split(",") if t]
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{flag}: comma-separated token counts, {err}.") from None


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_cache(text: str) -> tuple[str, str, dict]:
    """ "NAME" or "NAME:key=value,key=value" (values as JSON when they parse: 4, 0.25, "25%", true) or
    "NAME:{json}" -> (label, name, config)."""
    name, _, rest = text.partition(":")
    name = name.strip()
    config: dict = {}
    rest = rest.strip()
    if rest.startswith("{"):
        try:
            config = json.loads(rest)
        except json.JSONDecodeError as err:
            raise ValueError(f"--cache {text!r}: the config is not valid JSON ({err}).") from None
    elif rest:
        for part in rest.split(","):
            if "=" not in part:
                raise ValueError(f"--cache {text!r}: expected key=value pairs after ':', got {part!r}.")
            k, v = part.split("=", 1)
            config[k.strip()] = _value(v.strip())
    return text, name, config
