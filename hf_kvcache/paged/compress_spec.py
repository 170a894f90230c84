"""Which prompt tokens a continuous-batching request keeps: a validated spec read from the continuous-batching config,
`hf-kvcache serve --kv-compress` or a request's `kv_compress` field.

    cb = ContinuousBatchingConfig(num_blocks=64)
    cb.kv_compress = "keydiff:0.75"                         # METHOD:RATIO
    cb.kv_compress = 0.75                                   # the default method (keydiff) at that ratio
    cb.kv_compress = {"method": "snapkv", "ratio": 0.75, "window": 32}
    cb.kv_compress = "keydiff:0.75:chunk=256"               # METHOD:RATIO[:FIELD=VALUE...]: any field below
    cb.kv_compress = "none"                                 # (or None / absent) nothing evicted

`ratio` is the share of the prompt evicted, in [0, 1): a P-token prompt keeps ceil(P x (1 - ratio)) tokens in every
layer, chosen per layer (hf_kvcache.paged.prompt_scores). The methods are the registry's scorers that score a prompt
from what its forwards compute (`Scorer.prompt_reads`, hf_kvcache.scorers.registry: a scorer added there is a method
here, its own fields given as FIELD=VALUE or dict keys), and "sink_window":
- "keydiff" (default): the keys' distance to their mean direction (hf_kvcache.scorers.keydiff). Default because task
  accuracy through the server chooses it: on the needle tasks sent through `hf-kvcache serve` it keeps the most
  answers of the methods here (docs/serving.md, eval/results/ruler_http). KVzap, the best through `generate`, where
  KVzip's budgets differ per layer and head, falls furthest when every layer keeps the same number of tokens for all
  its heads, as pages require;
- "kvzap": KVzap's surrogate of KVzip's scores, from each layer's attention inputs (hf_kvcache.scorers.kvzap;
  `surrogate`: a directory, a Hub repo id or a builtin name; None: the one shipped for the model, if any);
- "snapkv": the attention of the prompt's last `observation` queries (hf_kvcache.scorers.snapkv), pooled;
- "knorm": the keys' norm (hf_kvcache.scorers.knorm);
- "sink_window": the first `sinks` tokens and the newest ones (StreamingLLM).
Every method keeps the first `sinks` tokens and the newest `window` ones (None: 64, at most a quarter of what is kept,
as KVzapCache's window), part of what is kept.

When eviction happens: `chunk` None (default) compresses once, when the prompt's last token has been written, so the
request holds its whole prompt while it prefills. `chunk=C` compresses every C prompt tokens as well: the request
writes at most C prompt tokens between two compressions, each keeping ceil(seen x (1 - ratio)) of the `seen` prompt
tokens so far, so it never holds more than about kept + C tokens (`peak`), at a cost in quality: later prompt tokens
are computed against the compressed earlier ones, and a token dropped early cannot come back (kvpress's chunked
presses score chunks apart but prefill whole). Not for snapkv, whose window is the prompt's last queries.

Errors name the field (`kv_compress`, `kv_compress.ratio`, ...) and the allowed values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..scorers.registry import SCORERS, options_of

FIELD = "kv_compress"
#: "sink_window" keeps by position only; every other method is a registry scorer that scores a whole prompt
SINK_WINDOW = "sink_window"
METHODS = (*(name for name, cls in SCORERS.items() if cls.prompt_reads), SINK_WINDOW)
DEFAULT_METHOD = "keydiff"
NONE = "none"
#: the newest prompt tokens always kept when `window` is None: this many, at most a quarter of what is kept
RECENT = 64
#: SnapKV's observation window and pooling kernel (kvpress SnapKVPress's defaults)
OBSERVATION, KERNEL = 64, 5


@dataclass(frozen=True)
class CompressSpec:
    """What a request keeps of its prompt (see the module docstring)."""

    method: str = DEFAULT_METHOD
    ratio: float = 0.75
    sinks: int = 4
    window: int | None = None
    surrogate: str | None = None  # kvzap only
    observation: int = OBSERVATION  # snapkv only
    kernel: int = KERNEL  # snapkv only
    chunk: int | None = None  # compress every `chunk` prompt tokens too (None: once, at the prompt's end)
    options: dict = field(default_factory=dict)  # the method's scorer's own other fields (options_of)

    def __post_init__(self):
        if self.method not in METHODS:
            cls = SCORERS.get(self.method)
            hint = (
                " (KVzip's reconstruction runs model forwards of its own, which continuous batching does not schedule: "
                "'kvzap' predicts its scores)"
                if cls is not None and cls.needs_model_forwards
                else f" (scorer {self.method!r} cannot score a prompt on its own: it has no `score`)"
                if cls is not None
                else ""
            )
            raise ValueError(f"`{FIELD}.method` must be one of {METHODS}, got {self.method!r}{hint}.")
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 <= ratio < 1):
            raise ValueError(
                f"`{FIELD}.ratio` (the share of the prompt evicted) must be a number in [0, 1), got {ratio!r}."
            )
        optional = tuple(name for name in ("window", "chunk") if getattr(self, name) is not None)
        for name in ("sinks", "observation", "kernel") + optional:
            value = getattr(self, name)
            low = 1 if name in ("observation", "kernel", "chunk") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{FIELD}.{name}` must be an integer >= {low}, got {value!r}.")
        if self.kernel % 2 == 0:
            raise ValueError(f"`{FIELD}.kernel` must be odd (pooling keeps the prompt's length), got {self.kernel}.")
        if self.options:
            own = options_of(self.method) if self.method in SCORERS else ()
            unknown = sorted(set(self.options) - set(own) - {"window", "kernel"})
            if unknown:
                raise ValueError(
                    f"`{FIELD}` has unknown keys {unknown} for method {self.method!r}; its scorer's own fields: "
                    f"{tuple(n for n in own if n not in ('window', 'kernel')) or 'none'}."
                )
            try:
                SCORERS[self.method](**self.options)
            except (TypeError, ValueError) as error:
                raise ValueError(f"`{FIELD}`: {error}") from None
        if self.chunk is not None and "queries" in getattr(SCORERS.get(self.method), "prompt_reads", ()):
            raise ValueError(
                f"`{FIELD}.chunk` cannot be used with method {self.method!r} (its window is the prompt's last queries, "
                f"which a chunk does not have yet); use one of {_chunkable()} or chunk None."
            )
        if self.surrogate is not None and (self.method != "kvzap" or not isinstance(self.surrogate, str)):
            raise ValueError(
                f"`{FIELD}.surrogate` is a directory, Hub repo id or builtin name for method 'kvzap', got "
                f"{self.surrogate!r} with method {self.method!r}."
            )

    def kept(self, prompt: int) -> int:
        """Tokens a `prompt`-token prompt keeps: ceil(prompt x (1 - ratio)), at least 1."""
        return max(1, min(prompt, math.ceil(prompt * (1 - self.ratio) - 1e-9)))

    def peak(self, prompt: int) -> int:
        """The most prompt tokens a `prompt`-token request holds at once while it prefills: the whole prompt, or with
        `chunk`, what the last compression kept plus the chunk written after it (at most about kept + chunk)."""
        if self.chunk is None:
            return prompt
        peak, held, seen = 0, 0, 0
        while seen < prompt:
            step = min(self.chunk, prompt - seen)
            peak, seen = max(peak, held + step), seen + step
            held = self.kept(seen)
        return peak

    def protected(self, kept: int) -> tuple[int, int]:
        """(first, newest) tokens always kept when `kept` are: `sinks` and `window` (None: RECENT, at most a quarter
        of `kept`; "sink_window": all the rest), within `kept`."""
        sinks = min(self.sinks, kept)
        if self.method == "sink_window":
            return sinks, kept - sinks
        window = min(RECENT, kept // 4) if self.window is None else self.window
        return sinks, min(window, kept - sinks)

    def label(self) -> str:
        """METHOD:RATIO, then :FIELD=VALUE for each other field not at its default (what `parse` reads back), as the
        benchmarks' rows and GET /v1/kv_cache name it."""
        default = CompressSpec()
        extra = "".join(
            f":{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in ("method", "ratio", "options") and getattr(self, f.name) != getattr(default, f.name)
        ) + "".join(f":{name}={value}" for name, value in sorted(self.options.items()))
        return f"{self.method}:{self.ratio:g}{extra}"

    def to_dict(self) -> dict[str, Any]:
        """The fields, the scorer's own options among them (what `parse` reads back)."""
        fields_ = asdict(self)
        return {**{k: v for k, v in fields_.items() if k != "options"}, **fields_["options"]}


def _chunkable() -> tuple[str, ...]:
    return tuple(m for m in METHODS if "queries" not in getattr(SCORERS.get(m), "prompt_reads", ()))


def parse(value: Any, field: str = FIELD) -> CompressSpec | None:
    """The spec for a `kv_compress` value (see the module docstring); None for no compression ("none", None, ratio 0).
    `field` is what errors name (e.g. the request field or the --kv-compress flag)."""
    if value is None or value == NONE:
        return None
    try:
        if isinstance(value, CompressSpec):
            spec = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            spec = CompressSpec(ratio=value)
        elif isinstance(value, str):
            method, sep, rest = value.partition(":")
            if not sep:
                try:
                    return parse(float(value), field)
                except ValueError:
                    method, rest = value, ""
            ratio, *extras = rest.split(":")
            if not ratio:
                raise ValueError(
                    f"`{FIELD}` must be 'none', a ratio, 'METHOD:RATIO[:FIELD=VALUE...]' or a dict, with METHOD one of "
                    f"{METHODS}; got {value!r}."
                )
            try:
                number = float(ratio)
            except ValueError:
                raise ValueError(f"`{FIELD}.ratio` must be a number in [0, 1), got {ratio!r} in {value!r}.") from None
            spec = _from_dict({"method": method, "ratio": number, **dict(_field_value(e, value) for e in extras)})
        elif isinstance(value, dict):
            spec = _from_dict(value)
        else:
            raise ValueError(
                f"`{FIELD}` must be 'none', a ratio, 'METHOD:RATIO[:FIELD=VALUE...]' or a dict, got "
                f"{type(value).__name__}."
            )
    except ValueError as error:
        message = str(error)
        if field != FIELD:
            message = message.replace(f"`{FIELD}", f"`{field}")
        raise ValueError(message) from None
    return None if spec.ratio == 0 else spec


def _from_dict(value: dict) -> CompressSpec:
    allowed = tuple(f.name for f in fields(CompressSpec) if f.name != "options")
    method = value.get("method", DEFAULT_METHOD)
    own = options_of(method) if method in SCORERS else ()
    options = {k: v for k, v in value.items() if k not in allowed and k in own}
    if options:
        value = {**{k: v for k, v in value.items() if k not in options}, "options": options}
    unknown = sorted(set(value) - set(allowed) - {"options"})
    if unknown:
        raise ValueError(f"`{FIELD}` has unknown keys {unknown}; allowed keys are {allowed}.")
    return CompressSpec(**value)


def _field_value(text: str, value: str) -> tuple[str, Any]:
    """One FIELD=VALUE of a 'METHOD:RATIO:FIELD=VALUE' string: an integer, None, or text (a surrogate's name)."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"`{FIELD}`: {text!r} in {value!r} is not FIELD=VALUE (e.g. 'keydiff:0.75:chunk=256').")
    if raw == "None":
        return name, None
    try:
        return name, int(raw)
    except ValueError:
        return name, raw


def from_cb_config(cb_config) -> CompressSpec | None:
    """The `kv_compress` field of a ContinuousBatchingConfig (absent: None)."""
    return parse(getattr(cb_config, FIELD, None))
