"""Sweep specs: parse and validate a YAML spec (or a dict) into a `Sweep`, before any model is loaded.

The spec format is documented in `hf_kvcache.evaluation.sweep`. Every field is checked; an error is a `SpecError`
whose message starts with the offending field (`caches[2].name: unknown cache 'sinkk'; valid names are ...`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sharing.models import OFFLINE_MODELS

__all__ = ["METRICS", "CacheEntry", "SpecError", "Sweep", "load_spec"]

METRICS = ("quality", "ppl", "speed", "retrieval")
METRIC_ALIASES = {
    "kl": "quality",
    "divergence": "quality",
    "top1": "quality",
    "bytes": "quality",
    "ms_per_token": "quality",
    "perplexity": "ppl",
}
DTYPES = ("float32", "bfloat16", "float16")
TOP_KEYS = {
    "name",
    "description",
    "model",
    "dtype",
    "threads",
    "text",
    "text_offset",
    "context_lengths",
    "scored_tokens",
    "prefill_chunk",
    "metrics",
    "budgets",
    "caches",
    "ppl",
    "speed",
    "retrieval",
    "seed",
}
CACHE_KEYS = {"name", "config", "budget_key", "budgets", "label"}
PPL_DEFAULTS = {"tokens": 4096, "mode": "chunked", "chunk": 64, "bucket": 1024}
SPEED_DEFAULTS = {"decode_tokens": 32, "rounds": 3}
RETRIEVAL_DEFAULTS = {
    "kinds": ["passkey"],
    "positions": ["early", "middle", "late"],
    "samples": 2,
    "context_lengths": None,
    "chat": False,
    "max_new_tokens": None,
    "records": None,
}


class SpecError(ValueError):
    """A bad sweep spec; the message starts with the offending field."""


def _err(where: str, msg: str) -> SpecError:
    return SpecError(f"{where}: {msg}")


def _is_int(v, minimum=1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _check_section(where: str, given: Any, defaults: dict) -> dict:
    if given is None:
        return dict(defaults)
    if not isinstance(given, dict):
        raise _err(where, f"must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise _err(where, f"unknown key(s) {unknown}; valid keys are {sorted(defaults)}")
    return {**defaults, **given}


@dataclass
class CacheEntry:
    name: str
    config: dict
    budget_key: str | None
    budgets: list | None
    label: str | None

    def variants(self, default_budgets: list) -> list[tuple[Any, dict, str]]:
        """(budget or None, unresolved config, label) for each budget of this cache."""
        if self.budget_key is None:
            return [(None, dict(self.config), self.label or self.name)]
        out = []
        for b in self.budgets if self.budgets is not None else default_budgets:
            cfg = {**self.config, self.budget_key: b}
            base = self.label or self.name
            out.append((b, cfg, f"{base} {_budget_text(b)}"))
        return out


def _budget_text(b) -> str:
    if isinstance(b, float):
        return f"{b:.0%}" if b * 100 == round(b * 100) else f"{b:.1%}"
    return str(b)


@dataclass
class Sweep:
    name: str
    model: str
    dtype: str = "float32"
    threads: int | None = None
    text: str = "pydoc"
    text_offset: int = 20000
    context_lengths: list = field(default_factory=lambda: [2048])
    scored_tokens: int = 128
    prefill_chunk: int | None = None
    metrics: list = field(default_factory=lambda: ["quality"])
    budgets: list = field(default_factory=list)
    caches: list = field(default_factory=list)
    ppl: dict = field(default_factory=lambda: dict(PPL_DEFAULTS))
    speed: dict = field(default_factory=lambda: dict(SPEED_DEFAULTS))
    retrieval: dict = field(default_factory=lambda: dict(RETRIEVAL_DEFAULTS))
    seed: int = 0
    description: str = ""
    raw: dict = field(default_factory=dict)

    def settings_digest(self) -> str:
        """Digest of what changes every cell's results (not the cache list, budgets or metrics)."""
        keys = ("model", "dtype", "text", "text_offset", "scored_tokens", "prefill_chunk", "seed")
        data = {k: getattr(self, k) for k in keys}
        return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def _check_model(where: str, model: Any) -> None:
    if not isinstance(model, str) or not model:
        raise _err(
            where, f"must be a Hub id, a local path or an offline model ({', '.join(OFFLINE_MODELS)}), got {model!r}"
        )
    if model in OFFLINE_MODELS:
        return
    looks_local = model.startswith((".", "/", "~")) or (os.sep in model and os.path.exists(model.split(os.sep)[0]))
    if looks_local and not os.path.isdir(os.path.expanduser(model)):
        raise _err(where, f"local model directory {model!r} does not exist")
    if not looks_local and not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", model):
        raise _err(where, f"{model!r} is neither an existing directory nor a Hub id like 'org/name'")


def _check_text(where: str, text: Any) -> None:
    if not isinstance(text, str):
        raise _err(where, f"must be a string, got {text!r}")
    if text in ("pydoc", "random") or text.startswith("hf:"):
        return
    if not os.path.isfile(text):
        raise _err(where, f"{text!r} is not 'pydoc', 'random', 'hf:DATASET' or an existing text file")


def _check_budget(where: str, b: Any) -> None:
    from .cache_spec import _fraction

    frac = _fraction(b)
    if frac is not None:
        if not 0 < frac <= 1:
            raise _err(where, f"a budget fraction must be in (0, 1], got {b!r}")
    elif not _is_int(b):
        raise _err(where, f"a budget is a number of tokens (int >= 1) or a fraction in (0, 1] / 'N%', got {b!r}")


def load_spec(source: str | os.PathLike | dict) -> Sweep:
    """Parse and validate a spec (a YAML file or a dict) without loading any model."""
    from .cache_spec import check_cache

    if isinstance(source, dict):
        raw, default_name = dict(source), "sweep"
    else:
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"spec: file {str(path)!r} does not exist")
        import yaml

        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise SpecError(f"spec: {path} is not valid YAML: {err}") from err
        default_name = path.stem
    if not isinstance(raw, dict):
        raise SpecError("spec: the top level must be a mapping")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise _err(unknown[0], f"unknown field; valid fields are {sorted(TOP_KEYS)}")
    s = Sweep(name=raw.get("name", default_name), model=raw.get("model"), raw=raw)
    if not isinstance(s.name, str) or not re.fullmatch(r"[\w.\-]+", s.name):
        raise _err("name", f"must be a simple name (letters, digits, ._-), got {s.name!r}")
    if "model" not in raw:
        raise _err("model", "missing (a Hub id, a local path or 'smollm2')")
    _check_model("model", s.model)
    s.description = raw.get("description", "")
    if not isinstance(s.description, str):
        raise _err("description", f"must be a string, got {s.description!r}")
    s.dtype = raw.get("dtype", "float32")
    if s.dtype not in DTYPES:
        raise _err("dtype", f"must be one of {list(DTYPES)}, got {s.dtype!r}")
    s.threads = raw.get("threads")
    if s.threads is not None and not _is_int(s.threads):
        raise _err("threads", f"must be an integer >= 1, got {s.threads!r}")
    s.text = raw.get("text", "pydoc")
    _check_text("text", s.text)
    s.text_offset = raw.get("text_offset", 20000)
    if not _is_int(s.text_offset, 0):
        raise _err("text_offset", f"must be an integer >= 0, got {s.text_offset!r}")
    s.seed = raw.get("seed", 0)
    if not _is_int(s.seed, 0):
        raise _err("seed", f"must be an integer >= 0, got {s.seed!r}")
    s.context_lengths = raw.get("context_lengths", [2048])
    if not isinstance(s.context_lengths, list) or not s.context_lengths:
        raise _err("context_lengths", f"must be a non-empty list of token counts, got {s.context_lengths!r}")
    for i, c in enumerate(s.context_lengths):
        if not _is_int(c, 2):
            raise _err(f"context_lengths[{i}]", f"must be an integer >= 2, got {c!r}")
    s.scored_tokens = raw.get("scored_tokens", 128)
    if not _is_int(s.scored_tokens):
        raise _err("scored_tokens", f"must be an integer >= 1, got {s.scored_tokens!r}")
    s.prefill_chunk = raw.get("prefill_chunk")
    if s.prefill_chunk is not None and not _is_int(s.prefill_chunk):
        raise _err("prefill_chunk", f"must be null or an integer >= 1, got {s.prefill_chunk!r}")
    metrics = raw.get("metrics", ["quality"])
    if not isinstance(metrics, list) or not metrics:
        raise _err("metrics", f"must be a non-empty list from {list(METRICS)}, got {metrics!r}")
    s.metrics = []
    for i, m in enumerate(metrics):
        m = METRIC_ALIASES.get(m, m)
        if m not in METRICS:
            raise _err(
                f"metrics[{i}]",
                f"unknown metric {metrics[i]!r}; valid metrics are {list(METRICS)} (aliases {sorted(METRIC_ALIASES)})",
            )
        if m not in s.metrics:
            s.metrics.append(m)
    s.budgets = raw.get("budgets", [])
    if not isinstance(s.budgets, list):
        raise _err("budgets", f"must be a list, got {s.budgets!r}")
    for i, b in enumerate(s.budgets):
        _check_budget(f"budgets[{i}]", b)
    s.ppl = _check_section("ppl", raw.get("ppl"), PPL_DEFAULTS)
    for key in ("tokens", "chunk", "bucket"):
        if not _is_int(s.ppl[key], 2 if key == "tokens" else 1):
            raise _err(f"ppl.{key}", f"must be a positive integer, got {s.ppl[key]!r}")
    if s.ppl["mode"] not in ("stream", "chunked"):
        raise _err("ppl.mode", f"must be 'stream' or 'chunked', got {s.ppl['mode']!r}")
    s.speed = _check_section("speed", raw.get("speed"), SPEED_DEFAULTS)
    for key in ("decode_tokens", "rounds"):
        if not _is_int(s.speed[key]):
            raise _err(f"speed.{key}", f"must be an integer >= 1, got {s.speed[key]!r}")
    s.retrieval = _check_section("retrieval", raw.get("retrieval"), RETRIEVAL_DEFAULTS)
    _check_retrieval(s)
    caches = raw.get("caches")
    if not isinstance(caches, list) or not caches:
        raise _err("caches", "must be a non-empty list of {name, config, budget_key, budgets, label}")
    for i, c in enumerate(caches):
        where = f"caches[{i}]"
        if isinstance(c, str):
            c = {"name": c}
        if not isinstance(c, dict):
            raise _err(where, f"must be a mapping or a cache name, got {c!r}")
        unknown = sorted(set(c) - CACHE_KEYS)
        if unknown:
            raise _err(where, f"unknown key(s) {unknown}; valid keys are {sorted(CACHE_KEYS)}")
        if "name" not in c:
            raise _err(f"{where}.name", "missing")
        entry = CacheEntry(c["name"], c.get("config") or {}, c.get("budget_key"), c.get("budgets"), c.get("label"))
        if entry.budgets is not None:
            if not isinstance(entry.budgets, list) or not entry.budgets:
                raise _err(f"{where}.budgets", f"must be a non-empty list, got {entry.budgets!r}")
            for j, b in enumerate(entry.budgets):
                _check_budget(f"{where}.budgets[{j}]", b)
        if entry.budget_key is not None:
            if not isinstance(entry.budget_key, str):
                raise _err(f"{where}.budget_key", f"must be a config key name, got {entry.budget_key!r}")
            if entry.budgets is None and not s.budgets:
                raise _err(f"{where}.budget_key", "is set but neither `budgets` nor this cache's `budgets` is given")
            from .cache_spec import BUILTIN_CACHES, available_caches, config_keys

            known = entry.name in BUILTIN_CACHES or entry.name in available_caches()["hf_kvcache"]
            if known and entry.budget_key not in config_keys(entry.name):
                raise _err(
                    f"{where}.budget_key",
                    f"{entry.budget_key!r} is not a config key of cache "
                    f"{entry.name!r}; valid keys are {sorted(config_keys(entry.name))}",
                )
            if isinstance(entry.config, dict) and entry.budget_key in entry.config:
                raise _err(
                    f"{where}.config.{entry.budget_key}",
                    "is also `budget_key`, which sets it from the budgets; remove it from `config`",
                )
        elif entry.budgets is not None:
            raise _err(f"{where}.budgets", "needs `budget_key` (the config key each budget goes to)")
        lengths = _lengths_for(s)
        for _budget, cfg, _ in entry.variants(s.budgets):
            for n in lengths:
                try:
                    check_cache(entry.name, cfg, context_len=n, where=f"{where}")
                except ValueError as err:
                    msg = str(err)
                    if msg.startswith(where):
                        raise SpecError(msg) from None
                    raise _err(where, msg) from None
        s.caches.append(entry)
    labels = [label for e in s.caches for _, _, label in e.variants(s.budgets)]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise _err("caches", f"duplicate cache labels {dup}; give each a distinct `label`")
    return s


def _lengths_for(s: Sweep) -> list[int]:
    lengths = list(s.context_lengths)
    if "retrieval" in s.metrics:
        lengths += list(s.retrieval["context_lengths"] or s.context_lengths)
    return sorted(set(lengths))


def _check_retrieval(s: Sweep) -> None:
    from .retrieval import KINDS, POSITIONS

    r = s.retrieval
    if not isinstance(r["kinds"], list) or not r["kinds"]:
        raise _err("retrieval.kinds", f"must be a non-empty list from {list(KINDS)}")
    for i, k in enumerate(r["kinds"]):
        if k not in KINDS:
            raise _err(f"retrieval.kinds[{i}]", f"unknown probe {k!r}; valid probes are {list(KINDS)}")
    if not isinstance(r["positions"], list) or not r["positions"]:
        raise _err("retrieval.positions", f"must be a non-empty list of {list(POSITIONS)} or depths in [0, 1]")
    for i, p in enumerate(r["positions"]):
        ok = p in POSITIONS or (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1)
        if not ok:
            raise _err(f"retrieval.positions[{i}]", f"must be one of {list(POSITIONS)} or a depth in [0, 1], got {p!r}")
    if not _is_int(r["samples"]):
        raise _err("retrieval.samples", f"must be an integer >= 1, got {r['samples']!r}")
    if r["records"] is not None and (not _is_int(r["records"]) or r["records"] < 2):
        raise _err(
            "retrieval.records",
            f"must be an integer >= 2 (records in the context, target included) or null, got {r['records']!r}",
        )
    if r["context_lengths"] is not None:
        if not isinstance(r["context_lengths"], list) or not r["context_lengths"]:
            raise _err("retrieval.context_lengths", "must be a non-empty list of token counts")
        for i, c in enumerate(r["context_lengths"]):
            if not _is_int(c, 64):
                raise _err(f"retrieval.context_lengths[{i}]", f"must be an integer >= 64, got {c!r}")
    if not isinstance(r["chat"], bool):
        raise _err("retrieval.chat", f"must be true or false, got {r['chat']!r}")
    if r["max_new_tokens"] is not None and not _is_int(r["max_new_tokens"]):
        raise _err("retrieval.max_new_tokens", f"must be null or an integer >= 1, got {r['max_new_tokens']!r}")
    if "retrieval" in s.metrics and s.text == "random":
        raise _err("retrieval", "retrieval probes need a tokenizer; `text: random` is for tokenizer-free models")
