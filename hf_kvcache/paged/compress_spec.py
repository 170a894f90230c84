"""Which prompt tokens a continuous-batching request keeps: a validated spec read from the continuous-batching config,
`hf-kvcache serve --kv-compress` or a request's `kv_compress` field.

    cb = ContinuousBatchingConfig(num_blocks=64)
    cb.kv_compress = "keydiff:budget=0.25"                  # METHOD[:FIELD=VALUE...]: keydiff keeps 25% of the prompt
    cb.kv_compress = "budget=256"                           # the model's default method, 256 prompt tokens kept
    cb.kv_compress = {"method": "snapkv", "budget": 0.25, "recent": 32}
    cb.kv_compress = "keydiff:budget=0.25:chunk=256"        # any field below as FIELD=VALUE
    cb.kv_compress = "none"                                 # (or None / absent) nothing evicted

`budget` is what the prompt keeps, as `generate`'s `budget=` (docs/vocabulary.md): a float in (0, 1] is the share kept,
ceil(P x budget) tokens of a P-token prompt, at least 1 (1.0: nothing evicted, as "none"); an integer >= 1 is a number
of tokens, min(P, budget). Every layer keeps that many, chosen per layer (hf_kvcache.paged.prompt_scores). The methods
are the registry's scorers that score a prompt from what its forwards compute (`Scorer.prompt_reads`,
hf_kvcache.scorers.registry: a scorer added there is a method here, its own fields given as FIELD=VALUE or dict keys),
and "sink_window". No method named: chosen per model when the spec meets one (eviction_checks.for_model), by the
needle answers through the server (docs/serving.md, eval/results/ruler_http): "kvzap" where a surrogate fits the model
(one given, or the one shipped for it), else "keydiff";
- "kvzap": KVzap's surrogate of KVzip's scores, from each layer's attention inputs (hf_kvcache.scorers.kvzap;
  `surrogate`: a directory, a Hub repo id or a builtin name; None: the one shipped for the model, if any);
- "keydiff": the keys' distance to their mean direction (hf_kvcache.scorers.keydiff);
- "snapkv": the attention of the prompt's last `window` queries (hf_kvcache.scorers.snapkv: `window` 64 and `kernel`
  5, its own fields, as in SnapKVCache), pooled;
- "knorm": the keys' norm (hf_kvcache.scorers.knorm);
- "sink_window": the first `sinks` tokens and the newest ones (StreamingLLM).
Every method keeps the first `sinks` tokens and the newest `recent` ones (None: 64, at most a quarter of what is kept,
as KVzapCache's recent window), part of what is kept.

On head pages (`kv_compress_layout` "head": hf_kvcache.paged.head_pages) each (layer, KV head) keeps its own share,
as KVzipCache allots it: `layer_budget`, `head_budget` ("adaptive" or "uniform"), `safeguard` (refused on token pages).

When eviction happens: `chunk="end"` compresses once, when the prompt's last token has been written, so the request
holds its whole prompt while it prefills. `chunk=C` compresses every C prompt tokens as well: the request
writes at most C prompt tokens between two compressions, each keeping the WHOLE prompt's budget K = kept(P) of a
P-token prompt (the prompt is known when the request arrives), or everything while fewer than K tokens are held
(`kept_so_far`). So a request never holds more than K + C prompt tokens (`peak`), and nothing is evicted before it
has to be: with scores fixed when a token arrives (KVzap, Knorm) a token dropped early is one the end-of-prompt
compression would drop too (it was not among the best K of a subset). What chunks still cost: later prompt tokens are
computed against the compressed earlier ones (kvpress's chunked presses score chunks apart but prefill whole). Not
for snapkv, whose window is the prompt's last queries. `chunk` None (not given): CHUNK for a method scoring each token
as it arrives (kvzap), the prompt's end for the others (eviction_checks.default_chunk).

Deprecated until hf-kvcache 0.4 (a FutureWarning says what to write instead), with their old meaning: a number as the
share EVICTED (`0.75`, `"0.75"`, `"keydiff:0.75"`, the key `ratio`: budget 0.25), `window` for `recent` (for methods
whose scorer has no `window` of its own: SnapKV's is its observation window), and `observation` for SnapKV's `window`.
`label()` still names a share-kept spec by its share evicted ("keydiff:0.75"), the name the committed results and
docs/results.md use.

Errors name the field (`kv_compress`, `kv_compress.budget`, `kv_compress.ratio` for the old spelling, ...) and the
allowed values.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import InitVar, asdict, dataclass, field, fields
from typing import Any

from ..scorers.registry import SCORERS, options_of
from .page_layout import DEFAULT_LAYOUT, LAYOUT_FIELD, LAYOUTS, default_layout, layout_of  # noqa: F401 (here too)

FIELD = "kv_compress"
#: "sink_window" keeps by position only; every other method is a registry scorer that scores a whole prompt
SINK_WINDOW = "sink_window"
METHODS = (*(n for n, cls in SCORERS.items() if cls.prompt_reads), SINK_WINDOW)
NONE = "none"
#: `layer_budget` / `head_budget` in head pages, KVzipCache's vocabulary
ALLOTMENTS = ("uniform", "adaptive")
#: `safeguard` when not given (KVzipCache's)
SAFEGUARD = 0.2
#: what a prompt keeps when `budget` is not given: a quarter of it
BUDGET = 0.25
#: the newest prompt tokens always kept when `recent` is None: this many, at most a quarter of what is kept
RECENT = 64
#: `chunk`: compress once, at the prompt's end; and the default of methods scoring tokens as they arrive (kvzap), in
#: prompt tokens: a request holds at most kept + CHUNK of its prompt (docs/serving.md, eval/results/ruler_http)
END, CHUNK = "end", 256
#: the release that drops the old spellings (a number as the share evicted, `ratio`, `window`)
REMOVED_IN = "0.4"


@dataclass(frozen=True)
class CompressSpec:
    """What a request keeps of its prompt (see the module docstring). `ratio`, `window` and `observation` are the
    deprecated keywords for `budget` (as 1 - ratio), `recent` and SnapKV's `window`: read at construction, not stored
    (a `window` is the scorer's own where it has one)."""

    method: str | None = None  # None: the model's default (eviction_checks.for_model)
    budget: float | int | None = None  # the share of the prompt kept, or tokens kept (None: BUDGET)
    sinks: int = 4
    recent: int | None = None
    surrogate: str | None = None  # kvzap only
    chunk: int | str | None = None  # compress every `chunk` prompt tokens too; END: at the end only; None: default
    layer_budget: str | None = None  # head pages: "adaptive" (None) or "uniform", as KVzipCache's
    head_budget: str | None = None  # head pages: "adaptive" (None) or "uniform", as KVzipCache's
    safeguard: float | None = None  # head pages, adaptive heads: the share of a head's budget it keeps (None: 0.2)
    options: dict = field(default_factory=dict)  # the method's scorer's own other fields (options_of)
    ratio: InitVar[float | None] = None  # deprecated: the share evicted
    window: InitVar[int | None] = None  # deprecated: `recent` (the scorer's own `window` where it has one)
    observation: InitVar[int | None] = None  # deprecated: SnapKV's `window`

    def __post_init__(self, ratio, window, observation):
        own = options_of(self.method) if self.method in SCORERS else ()
        if "window" in own and window is not None:  # the scorer's own field, not the old `recent`
            object.__setattr__(self, "options", {**self.options, "window": window})
            window = None
        if observation is not None:
            object.__setattr__(self, "options", _observation(self.method, observation, self.options))
        old = {"ratio": ratio, "window": window, "observation": observation}
        new = _renamed(self.budget, self.recent, ratio, window)
        object.__setattr__(self, "budget", new[0])
        object.__setattr__(self, "recent", new[1])
        if self.method is not None and self.method not in METHODS:
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
        optional = tuple(name for name in ("recent", "chunk") if getattr(self, name) not in (None, END))
        for name in ("sinks",) + optional:
            value = getattr(self, name)
            low, end = (1, f" or {END!r}") if name == "chunk" else (0, "")
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{FIELD}.{name}` must be an integer >= {low}{end}, got {value!r}.")
        if self.options:
            unknown = sorted(set(self.options) - set(own))
            if unknown:
                raise ValueError(
                    f"`{FIELD}` has unknown keys {unknown} for method {self.method!r}; its scorer's own fields: "
                    f"{own or 'none'}."
                )
            try:
                SCORERS[self.method](**self.options)  # the scorer validates its fields, naming them
            except (TypeError, ValueError) as error:
                raise ValueError(str(error).replace("`", f"`{FIELD}.", 1)) from None
        if self.every() is not None and "queries" in getattr(SCORERS.get(self.method), "prompt_reads", ()):
            raise ValueError(
                f"`{FIELD}.chunk` cannot be used with method {self.method!r} (its window is the prompt's last queries, "
                f"which a chunk does not have yet); use one of {_chunkable()} or chunk {END!r}."
            )
        self._check_allotment()
        if self.surrogate is not None and (self.method not in ("kvzap", None) or not isinstance(self.surrogate, str)):
            raise ValueError(
                f"`{FIELD}.surrogate` is a directory, Hub repo id or builtin name for method 'kvzap', got "
                f"{self.surrogate!r} with method {self.method!r}."
            )
        used = [name for name, value in old.items() if value is not None]
        if used:
            _deprecated(" and ".join(f"`{FIELD}.{name}`" for name in used), self)

    def _check_allotment(self) -> None:
        for name in ("layer_budget", "head_budget"):
            value = getattr(self, name)
            if value is not None and value not in ALLOTMENTS:
                raise ValueError(f"`{FIELD}.{name}` must be one of {ALLOTMENTS}, got {value!r}.")
        if self.safeguard is not None:
            safeguard = self.safeguard
            if isinstance(safeguard, bool) or not isinstance(safeguard, (int, float)) or not 0.0 <= safeguard <= 1.0:
                raise ValueError(
                    f"`{FIELD}.safeguard` (the share of its budget every head keeps) must be in [0, 1], got "
                    f"{safeguard!r}."
                )

    def check_layout(self, layout: str, field: str = FIELD, layout_field: str = LAYOUT_FIELD) -> None:
        """Raise ValueError naming the fields when this spec cannot run on pages laid out by `layout` (LAYOUTS);
        `field` / `layout_field`: how the message names `kv_compress` and `kv_compress_layout` (e.g. the flags)."""
        allotment = {"layer_budget": self.layer_budget, "head_budget": self.head_budget, "safeguard": self.safeguard}
        given = [name for name, value in allotment.items() if value is not None]
        if given and layout == "token":
            raise ValueError(
                f"`{field}.{given[0]}` is set, but the pages are laid out by token (`{layout_field}` 'token'): budgets "
                f"per layer and head need pages of one (layer, head); set `{layout_field}` 'head' or leave it out."
            )

    def allotment(self) -> tuple[str, str, float]:
        """(layer_budget, head_budget, safeguard) in head pages: KVzipCache's defaults where not given."""
        return (
            self.layer_budget or "adaptive",
            self.head_budget or "adaptive",
            SAFEGUARD if self.safeguard is None else float(self.safeguard),
        )

    def kept(self, prompt: int) -> int:
        """Tokens a `prompt`-token prompt keeps: ceil(prompt x budget) for a share, at least 1; min(prompt, budget)
        for a number of tokens."""
        if isinstance(self.budget, int):
            return min(prompt, self.budget)
        return max(1, min(prompt, math.ceil(prompt * self.budget - 1e-9)))

    def kept_so_far(self, seen: int, prompt: int) -> int:
        """Tokens a compression keeps once `seen` of a `prompt`-token prompt have been written (every `chunk` tokens
        and at its end): the whole prompt's budget kept(prompt), or all `seen` while they are fewer."""
        return min(seen, self.kept(prompt))

    def every(self) -> int | None:
        """Prompt tokens written between two compressions (`chunk`); None: once, at the prompt's end."""
        return None if self.chunk in (None, END) else self.chunk

    def peak(self, prompt: int) -> int:
        """The most prompt tokens a `prompt`-token request holds at once while it prefills: the whole prompt, or with
        `chunk`, what the last compression kept plus the chunk written after it (at most kept(prompt) + chunk)."""
        chunk = self.every()
        if chunk is None:
            return prompt
        peak, held, seen = 0, 0, 0
        while seen < prompt:
            step = min(chunk, prompt - seen)
            peak, seen = max(peak, held + step), seen + step
            held = self.kept_so_far(seen, prompt)
        return peak

    def protected(self, kept: int) -> tuple[int, int]:
        """(first, newest) tokens always kept when `kept` are: `sinks` and `recent` (None: RECENT, at most a quarter
        of `kept`; "sink_window": all the rest), within `kept`."""
        sinks = min(self.sinks, kept)
        if self.method == "sink_window":
            return sinks, kept - sinks
        recent = min(RECENT, kept // 4) if self.recent is None else self.recent
        return sinks, min(recent, kept - sinks)

    def label(self) -> str:
        """The spec's name in the benchmarks' rows and GET /v1/kv_cache: METHOD:EVICTED for a share kept (the share
        evicted, 1 - budget: "keydiff:0.75" keeps 25%, the names the committed results use) or METHOD:budget=N for N
        tokens, then :FIELD=VALUE for each other field not at its default. `parse` reads it back (a share's with the
        deprecation warning of the old spelling); `spelling()` is the same spec in today's spelling."""
        if isinstance(self.budget, int):
            return self.spelling()
        return f"{self.method}:{1 - self.budget:g}{self._extra()}" if self.method else self.spelling()

    def spelling(self) -> str:
        """METHOD:budget=BUDGET, then :FIELD=VALUE for each other field not at its default: what `parse` reads back
        to this spec."""
        return f"{self.method + ':' if self.method else ''}budget={self.budget!r}{self._extra()}"

    def _extra(self) -> str:
        default = CompressSpec()
        return "".join(
            f":{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in ("method", "budget", "options") and getattr(self, f.name) != getattr(default, f.name)
        ) + "".join(f":{name}={value}" for name, value in sorted(self.options.items()))

    def to_dict(self) -> dict[str, Any]:
        """The fields, the scorer's own options among them (what `parse` reads back)."""
        fields_ = asdict(self)
        return {**{k: v for k, v in fields_.items() if k != "options"}, **fields_["options"]}


def _chunkable() -> tuple[str, ...]:
    return tuple(m for m in METHODS if "queries" not in getattr(SCORERS.get(m), "prompt_reads", ()))


def _observation(method: str, observation, options: dict) -> dict:
    """The scorer's options with the deprecated `observation` as its `window` (SnapKV's observation window)."""
    if "window" not in (options_of(method) if method in SCORERS else ()):
        raise ValueError(
            f"`{FIELD}.observation` (deprecated: SnapKV's `window`) is given, but method {method!r} has no "
            "observation window."
        )
    if "window" in options:
        raise ValueError(
            f"`{FIELD}.window` and `{FIELD}.observation` are both given: give `window` (SnapKV's observation window) "
            "only; `observation` is its deprecated spelling."
        )
    return {**options, "window": observation}


def _renamed(budget, recent, ratio, window) -> tuple[float | int, int | None]:
    """(budget, recent) from the fields and their deprecated spellings, `ratio` checked with today's message (the
    share evicted) and turned into the share kept; both spellings of one thing given is an error naming both."""
    if ratio is not None:
        if budget is not None:
            raise ValueError(
                f"`{FIELD}.budget` and `{FIELD}.ratio` are both given: give `budget` (the share of the prompt kept) "
                f"only; `ratio` (the share evicted) is its deprecated spelling."
            )
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 <= ratio < 1):
            raise ValueError(
                f"`{FIELD}.ratio` (the share of the prompt evicted) must be a number in [0, 1), got {ratio!r}."
            )
        budget = round(1.0 - ratio, 12)
    if window is not None:
        if recent is not None:
            raise ValueError(
                f"`{FIELD}.recent` and `{FIELD}.window` are both given: give `recent` (the newest tokens always kept) "
                f"only; `window` is its deprecated spelling."
            )
        recent = window
    if budget is None:
        return BUDGET, recent
    tokens = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    if not tokens and not (isinstance(budget, float) and 0 < budget <= 1):
        raise ValueError(
            f"`{FIELD}.budget` (what the prompt keeps) must be a number of tokens (an integer >= 1) or a share of the "
            f"prompt in (0, 1], got {budget!r}."
        )
    return budget, recent


def _deprecated(what: str, spec: CompressSpec, stacklevel: int = 4) -> None:
    """The FutureWarning of an old spelling (`what`), with the spec in today's spelling."""
    warnings.warn(
        f"{what}: a deprecated spelling, accepted until hf-kvcache {REMOVED_IN}, where a number is the share of the "
        f"prompt EVICTED, `window` the newest tokens kept (now `recent`) and `observation` SnapKV's window (now "
        f"`window`, as in SnapKVCache); write {spec.spelling()!r} instead, or "
        f"the key 'budget': {spec.budget!r} (a budget is what the prompt keeps, as generate's `budget=`; "
        f"docs/vocabulary.md).",
        FutureWarning,
        stacklevel=stacklevel,
    )


def parse(value: Any, field: str = FIELD) -> CompressSpec | None:
    """The spec for a `kv_compress` value (see the module docstring); None for no compression ("none", None, budget
    1.0). `field` is what errors and deprecation warnings name (e.g. the request field or the --kv-compress flag)."""
    if value is None or value == NONE:
        return None
    try:
        old = None
        if isinstance(value, CompressSpec):
            spec = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            spec, old = _from_dict({"ratio": value}), f"`{FIELD}` {value!r}"
        elif isinstance(value, str):
            spec, old = _from_string(value)
        elif isinstance(value, dict):
            spec, old = _from_dict(value), _old_keys(value)
        else:
            raise ValueError(f"`{FIELD}` must be {SPELLINGS}, got {type(value).__name__}.")
    except ValueError as error:
        raise ValueError(_named(str(error), field)) from None
    if old:
        _deprecated(_named(old, field), spec, stacklevel=3)
    return None if isinstance(spec.budget, float) and spec.budget == 1.0 else spec


SPELLINGS = "'none', 'METHOD[:FIELD=VALUE...]' (e.g. 'keydiff:budget=0.25') or a dict"


def _named(text: str, field: str) -> str:
    return text if field == FIELD else text.replace(f"`{FIELD}", f"`{field}")


def _from_string(value: str) -> tuple[CompressSpec, str | None]:
    """'METHOD[:FIELD=VALUE...]', 'FIELD=VALUE[:...]' (the default method), or the old 'METHOD:EVICTED[:...]' and
    'EVICTED': the spec, and what names the old spelling if one was used."""
    head, *extras = value.split(":")
    if not extras:
        try:
            number = float(head)
        except ValueError:
            pass
        else:
            return _from_dict({"ratio": number}), f"`{FIELD}` {value!r}"
    if "=" in head:
        method, extras = None, [head, *extras]
    else:
        method = head
    items, old = {"method": method}, None
    if extras and "=" not in extras[0]:  # METHOD:EVICTED, the old positional number
        text = extras.pop(0)
        if not text:
            raise ValueError(f"`{FIELD}` must be {SPELLINGS}, with METHOD one of {METHODS}; got {value!r}.")
        try:
            items["ratio"] = float(text)
        except ValueError:
            raise ValueError(f"`{FIELD}.ratio` must be a number in [0, 1), got {text!r} in {value!r}.") from None
        old = f"`{FIELD}` {value!r}"
    items.update(_field_value(e, value) for e in extras)
    return _from_dict(items), old or _old_keys(items)


def _old_keys(value: dict) -> str | None:
    own = options_of(value.get("method")) if value.get("method") in SCORERS else ()
    old = ("ratio", "observation") + (() if "window" in own else ("window",))
    used = [f"`{FIELD}.{name}`" for name in old if name in value]
    return " and ".join(used) or None


def _from_dict(value: dict) -> CompressSpec:
    allowed = tuple(f.name for f in fields(CompressSpec) if f.name != "options")
    method = value.get("method")
    own = options_of(method) if method in SCORERS else ()
    options = {k: v for k, v in value.items() if k not in allowed and k in own}
    if options:
        value = {k: v for k, v in value.items() if k not in options}
    if "observation" in value:
        options = _observation(method, value["observation"], options)
        value = {k: v for k, v in value.items() if k != "observation"}
    unknown = sorted(set(value) - set(allowed) - {"ratio", "window"})
    if unknown:
        raise ValueError(
            f"`{FIELD}` has unknown keys {unknown}; allowed keys are {allowed}, the scorer's own fields "
            f"({own or 'none'} for {method!r}) and, deprecated, 'ratio' for 1 - budget, 'window' for 'recent', "
            "'observation' for SnapKV's 'window'."
        )
    given = {k: v for k, v in value.items() if k not in ("ratio", "window", "budget", "recent")}
    budget, recent = _renamed(value.get("budget"), value.get("recent"), value.get("ratio"), value.get("window"))
    return CompressSpec(**given, budget=budget, recent=recent, **({"options": options} if options else {}))


def _field_value(text: str, value: str) -> tuple[str, Any]:
    """One FIELD=VALUE of a 'METHOD:FIELD=VALUE' string: an integer, a number for `budget` (and the old `ratio`),
    None, or text (a surrogate's name)."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"`{FIELD}`: {text!r} in {value!r} is not FIELD=VALUE (e.g. 'keydiff:budget=0.25:chunk=256').")
    if raw == "None":
        return name, None
    try:
        return name, int(raw)
    except ValueError:
        pass
    if name in ("budget", "ratio", "safeguard"):
        try:
            return name, float(raw)
        except ValueError:
            pass
    return name, raw


def from_cb_config(cb_config) -> CompressSpec | None:
    """The `kv_compress` field of a ContinuousBatchingConfig (absent: None)."""
    return parse(getattr(cb_config, FIELD, None))
