"""Sweeps: a YAML spec of caches x budgets x metrics x context lengths, run cell by cell, resumable.

Spec (every field is checked before any model is loaded; an error names the field, e.g. `caches[2].name`):

```yaml
name: h2o-smollm2                 # results go to <out>/<name>/ (default: the file name)
model: smollm2                    # Hub id, local path, or "smollm2" (offline)
dtype: float32                    # float32 | bfloat16 | float16
threads: 2                        # torch threads
text: pydoc                       # "pydoc" (offline), a text file, "hf:DATASET", or "random" (random ids; tests)
text_offset: 20000                # where the tokens start in the text
context_lengths: [2048]           # prompt lengths; budget fractions resolve against them
scored_tokens: 128                # quality: tokens scored after the prompt, one per forward
prefill_chunk: null               # prefill in chunks of this many tokens (null: one forward)
metrics: [quality, speed]         # quality (ppl/KL/top-1/top-5/bytes/ms per token), ppl, speed, retrieval
budgets: [0.05, 0.1, 0.25, 0.5, 1.0]   # fractions of the context (float in (0, 1], "N%") or tokens (int)
caches:
  - name: dynamic                 # no budget_key: run once, as the reference
  - name: sink
    config: {sinks: 4}
    budget_key: budget            # which config key receives each budget
  - name: h2o
    budget_key: budget
    budgets: [0.1, 0.2]           # optional per-cache budgets
    label: H2O                    # optional display name
ppl: {tokens: 4096, mode: chunked, chunk: 64, bucket: 1024}
speed: {decode_tokens: 32, rounds: 3}
retrieval: {kinds: [passkey, records], positions: [early, middle, late], samples: 2, context_lengths: [4096],
            chat: false}
```

Cells: `quality` and `ppl` per (context length, cache, budget); `retrieval` per (cache, budget, kind, context
length, position); `speed` per context length (all caches interleaved in one cell, one row each). Every finished
cell is appended as one JSON line to `results.jsonl`, keyed by its parameters and by a digest of the settings that
change results (model, dtype, text, offset, scored tokens, ...). A restarted sweep skips cells already there, so an
interruption loses at most the cell that was running (exact `ppl` streams also checkpoint every 1024 tokens
inside the cell, under `checkpoints/`, and resume from there). `results.csv` (scalar columns), `summary.json` (spec,
environment, rows), `environment.json` and the plots are rewritten after every run.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["METRICS", "Cell", "SpecError", "Sweep", "load_spec", "plan_cells", "read_results", "run_sweep"]

METRICS = ("quality", "ppl", "speed", "retrieval")
METRIC_ALIASES = {"kl": "quality", "divergence": "quality", "top1": "quality", "bytes": "quality",
                  "ms_per_token": "quality", "perplexity": "ppl"}
DTYPES = ("float32", "bfloat16", "float16")
TOP_KEYS = {"name", "description", "model", "dtype", "threads", "text", "text_offset", "context_lengths",
            "scored_tokens", "prefill_chunk", "metrics", "budgets", "caches", "ppl", "speed", "retrieval", "seed"}
CACHE_KEYS = {"name", "config", "budget_key", "budgets", "label"}
PPL_DEFAULTS = {"tokens": 4096, "mode": "chunked", "chunk": 64, "bucket": 1024}
SPEED_DEFAULTS = {"decode_tokens": 32, "rounds": 3}
RETRIEVAL_DEFAULTS = {"kinds": ["passkey"], "positions": ["early", "middle", "late"], "samples": 2,
                      "context_lengths": None, "chat": False, "max_new_tokens": None, "records": None}


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
        raise _err(where, f"must be a Hub id, a local path or 'smollm2', got {model!r}")
    if model == "smollm2":
        return
    looks_local = model.startswith((".", "/", "~")) or os.sep in model and os.path.exists(model.split(os.sep)[0])
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
    s.description = str(raw.get("description", ""))
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
            raise _err(f"metrics[{i}]", f"unknown metric {metrics[i]!r}; valid metrics are {list(METRICS)} "
                                        f"(aliases {sorted(METRIC_ALIASES)})")
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
        elif entry.budgets is not None:
            raise _err(f"{where}.budgets", "needs `budget_key` (the config key each budget goes to)")
        lengths = _lengths_for(s)
        for budget, cfg, _ in entry.variants(s.budgets):
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
        raise _err("retrieval.records", f"must be an integer >= 2 (records in the context, target included) or null, "
                                        f"got {r['records']!r}")
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


# -- cells -------------------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    metric: str
    params: dict  # what identifies the cell (JSON-able)
    caches: list = field(default_factory=list)  # [(label, name, config, budget)]

    def key(self, digest: str) -> str:
        return json.dumps({"metric": self.metric, "settings": digest, **self.params}, sort_keys=True)


def plan_cells(s: Sweep) -> list[Cell]:
    """Every cell of the sweep, in run order."""
    variants = [(label, e.name, cfg, b) for e in s.caches for b, cfg, label in e.variants(s.budgets)]
    cells = []
    for n in s.context_lengths:
        for metric in ("quality", "ppl"):
            if metric in s.metrics:
                for label, name, cfg, b in variants:
                    params = {"context_len": n, "cache": name, "config": cfg, "label": label, "budget": b}
                    if metric == "ppl":
                        params["ppl"] = s.ppl
                    cells.append(Cell(metric, params, [(label, name, cfg, b)]))
        if "speed" in s.metrics:
            cells.append(Cell("speed", {"context_len": n, "caches": [[lb, nm, cf] for lb, nm, cf, _ in variants],
                                        "speed": s.speed}, variants))
    if "retrieval" in s.metrics:
        r = s.retrieval
        for n in r["context_lengths"] or s.context_lengths:
            for kind in r["kinds"]:
                for pos in r["positions"]:
                    for label, name, cfg, b in variants:
                        params = {"context_len": n, "kind": kind, "position": pos, "cache": name, "config": cfg,
                                  "label": label, "budget": b, "samples": r["samples"], "chat": r["chat"],
                                  "max_new_tokens": r["max_new_tokens"]}
                        cells.append(Cell("retrieval", params, [(label, name, cfg, b)]))
    return cells


# -- results files -----------------------------------------------------------------------------------------------------
def read_results(path: str | os.PathLike) -> dict[str, dict]:
    """{key: record} of a results.jsonl; a line cut short by an interruption is ignored."""
    path = Path(path)
    done = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "key" in rec:
            done[rec["key"]] = rec
    return done


def _append(path: Path, record: dict) -> None:
    """One line per record, fsynced; a line cut short by an earlier kill is closed first so it stays alone."""
    cut = False
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if cut else "") + json.dumps(record, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(o):
    import numpy as np

    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def environment() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    from .. import __version__

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "hf_kvcache": __version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "git_commit": commit}


SCALAR_FIRST = ["metric", "context_len", "label", "cache", "budget", "budget_tokens", "kind", "position"]


def write_reports(out: Path, spec: Sweep, records: list[dict], env: dict) -> list[dict]:
    """results.csv (scalar columns), summary.json and plots from all finished cells; returns the flat rows."""
    import csv

    rows = [row for rec in records for row in rec["rows"]]
    scalar_keys = []
    for r in rows:
        for k, v in r.items():
            if k not in scalar_keys and (v is None or isinstance(v, (int, float, str, bool))):
                scalar_keys.append(k)
    columns = [k for k in SCALAR_FIRST if k in scalar_keys] + [k for k in scalar_keys if k not in SCALAR_FIRST]
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in columns})
    os.replace(tmp, out / "results.csv")
    summary = {"spec": spec.raw, "environment": env, "rows": rows}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=_json_default))
    os.replace(tmp, out / "summary.json")
    try:
        from .plots import plot_all

        plot_all(rows, out)
    except ImportError:  # matplotlib is an optional extra
        pass
    return rows


# -- running -----------------------------------------------------------------------------------------------------------
class _Context:
    """What cells share in one run: the model, tokens and reference log-probs per context length."""

    def __init__(self, spec: Sweep, model, tokenizer, out: Path | None = None, digest: str = ""):
        self.spec, self.model, self.tokenizer, self.out, self.digest = spec, model, tokenizer, out, digest
        self._tokens = None
        self._refs: dict[int, Any] = {}

    def tokens(self, n: int):
        import torch

        s = self.spec
        need = s.text_offset + n
        if self._tokens is None or self._tokens.shape[1] < need:
            if s.text == "random":
                g = torch.Generator().manual_seed(s.seed)
                vocab = self.model.config.vocab_size
                self._tokens = torch.randint(2, vocab, (1, need), generator=g)
            else:
                from ..text import load_tokens

                self._tokens = load_tokens(self.tokenizer, s.text, max_tokens=need)
        return self._tokens[:, s.text_offset : s.text_offset + n]

    def reference(self, n: int):
        from transformers import DynamicCache

        from .divergence import cache_logprobs

        if n not in self._refs:
            ids = self.tokens(n + self.spec.scored_tokens)
            self._refs[n] = cache_logprobs(self.model, ids, DynamicCache(config=self.model.config), n,
                                           self.spec.prefill_chunk)
        return self._refs[n]


def _run_quality(ctx: _Context, cell: Cell) -> list[dict]:
    import torch

    from .cache_spec import make_cache, resolve_config
    from .divergence import cache_logprobs, divergence_metrics
    from .memory import Precision, cache_nbytes, expected_tokens, kv_cache_bytes, shape_from_config

    s, p = ctx.spec, cell.params
    n, total = p["context_len"], p["context_len"] + s.scored_tokens
    ids = ctx.tokens(total)
    ref = ctx.reference(n)
    resolved = resolve_config(p["cache"], p["config"], n)
    cache = make_cache(ctx.model, p["cache"], p["config"], context_len=n, total_len=total)
    t0 = time.perf_counter()
    logp = cache_logprobs(ctx.model, ids, cache, n, s.prefill_chunk)
    elapsed = time.perf_counter() - t0
    m = divergence_metrics(ref, logp, ids[0, n:].cpu())
    dtype = next(ctx.model.parameters()).dtype
    shape = shape_from_config(ctx.model.config)
    precision = Precision(str(dtype).replace("torch.", ""), torch.finfo(dtype).bits)
    held = cache_nbytes(cache)
    dense = kv_cache_bytes(shape, precision, total)
    return [{"metric": "quality", "context_len": n, "label": p["label"], "cache": p["cache"], "budget": p["budget"],
             "budget_tokens": _budget_tokens(resolved, p), "config": resolved, "scored_tokens": s.scored_tokens, **m,
             "bytes_held": held, "theory_bytes": kv_cache_bytes(shape, precision, expected_tokens(resolved, total)),
             "dense_bytes": dense, "bytes_vs_dense": held / dense,
             "score_ms_per_token": 1000 * elapsed / s.scored_tokens}]


def _budget_tokens(resolved: dict, p: dict):
    spec_budget = p.get("budget")
    if spec_budget is None:
        return None
    for key, value in p["config"].items():
        if value == spec_budget:
            return resolved.get(key)
    return None


def _run_ppl(ctx: _Context, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory, resolve_config
    from .perplexity import run_perplexity

    s, p = ctx.spec, cell.params
    n, cfg = p["context_len"], s.ppl
    ids = ctx.tokens(cfg["tokens"])
    factory = make_factory(ctx.model, (p["cache"], p["config"]), context_len=n, total_len=cfg["tokens"])
    kwargs, ckpt = {}, None
    if cfg["mode"] == "stream" and ctx.out is not None:
        # a long exact stream resumes inside the cell too (streaming.py checkpoints); removed once the cell is done
        key = cell.key(ctx.digest)
        ckpt = ctx.out / "checkpoints" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        kwargs = {"checkpoint": ckpt, "tag": key, "checkpoint_every": 1024}
    t0 = time.perf_counter()
    r = run_perplexity(ctx.model, ids, factory, mode=cfg["mode"], chunk=cfg["chunk"], bucket=cfg["bucket"],
                       **kwargs)
    if ckpt is not None:
        for path in (ckpt, Path(str(ckpt) + ".nlls.npy"), Path(str(ckpt) + ".json")):
            path.unlink(missing_ok=True)
    resolved = resolve_config(p["cache"], p["config"], n)
    return [{"metric": "ppl", "context_len": n, "label": p["label"], "cache": p["cache"], "budget": p["budget"],
             "budget_tokens": _budget_tokens(resolved, p), "config": resolved, "ppl": r["ppl"],
             "tokens": r["tokens"], "protocol": r["protocol"], "buckets": r["buckets"],
             "elapsed_s": time.perf_counter() - t0}]


def _run_speed(ctx: _Context, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory
    from .speed import measure_speed

    s, p = ctx.spec, cell.params
    n = p["context_len"]
    dec = s.speed["decode_tokens"]
    ids = ctx.tokens(n + dec)
    factories = {label: make_factory(ctx.model, (name, cfg), context_len=n, total_len=n + dec)
                 for label, name, cfg, _ in cell.caches}
    rows = measure_speed(ctx.model, ids, factories, n, decode_tokens=dec, rounds=s.speed["rounds"])
    budgets = {label: b for label, _, _, b in cell.caches}
    names = {label: name for label, name, _, _ in cell.caches}
    out = []
    for r in rows:
        label = r.pop("cache")
        out.append({"metric": "speed", "context_len": n, "label": label, "cache": names.get(label, "dynamic"),
                    "budget": budgets.get(label), **r})
    return out


def _run_retrieval(ctx: _Context, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory, resolve_config
    from .retrieval import run_retrieval

    s, p = ctx.spec, cell.params
    n = p["context_len"]
    factory = make_factory(ctx.model, (p["cache"], p["config"]), context_len=n, total_len=n + 64)
    rows = run_retrieval(ctx.model, ctx.tokenizer, factory, kinds=[p["kind"]], context_lens=[n],
                         positions=[p["position"]], samples=p["samples"], seed=s.seed,
                         prefill_chunk=s.prefill_chunk, chat=p["chat"], n_records=p.get("records"))
    resolved = resolve_config(p["cache"], p["config"], n)
    k = len(rows)
    return [{"metric": "retrieval", "context_len": n, "label": p["label"], "cache": p["cache"], "budget": p["budget"],
             "budget_tokens": _budget_tokens(resolved, p), "config": resolved, "kind": p["kind"],
             "position": rows[0]["position"], "samples": k,
             "exact_match": sum(r["exact"] for r in rows) / k, "parse_rate": sum(r["parsed"] for r in rows) / k,
             "value_match": sum(r["value_match"] for r in rows) / k,
             "outputs": [{"answer": r["answer"], "output": r["output"]} for r in rows]}]


RUNNERS: dict[str, Callable] = {"quality": _run_quality, "ppl": _run_ppl, "speed": _run_speed,
                                "retrieval": _run_retrieval}


def run_sweep(spec: Sweep | str | os.PathLike | dict, out_dir: str | os.PathLike = "eval/results",
              loader: Callable[[str, str], tuple] | None = None, progress: bool = True,
              on_cell: Callable[[Cell], None] | None = None, dry_run: bool = False,
              report_only: bool = False) -> list[dict]:
    """Run every cell not already in `<out_dir>/<name>/results.jsonl`; returns all rows (old and new).
    `loader(model, dtype) -> (model, tokenizer)` defaults to `hf_kvcache.models.load_model`. `on_cell` is called
    after each finished cell (tests use it to interrupt a run). `report_only` runs nothing and rewrites the reports
    from the cells already done (for a sweep stopped part-way)."""
    if not isinstance(spec, Sweep):
        spec = load_spec(spec)
    out = Path(out_dir) / spec.name
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    digest = spec.settings_digest()
    done = read_results(results)
    cells = plan_cells(spec)
    todo = [c for c in cells if c.key(digest) not in done]
    if dry_run:
        return [{"metric": c.metric, **c.params, "done": c.key(digest) in done} for c in cells]
    env = environment()
    if todo and not report_only:
        import torch

        if spec.threads:
            torch.set_num_threads(spec.threads)
        env["torch_threads"] = torch.get_num_threads()
        if loader is None:
            from ..models import load_model

            def loader(name, dtype):
                return load_model(name, dtype=getattr(torch, dtype))

        model, tokenizer = loader(spec.model, spec.dtype)
        ctx = _Context(spec, model, tokenizer, out, digest)
        runs = json.loads((out / "environment.json").read_text()) if (out / "environment.json").is_file() else []
        runs = runs if isinstance(runs, list) else [runs]
        runs.append({**env, "cells_planned": len(cells), "cells_to_run": len(todo)})
        (out / "environment.json").write_text(json.dumps(runs, indent=1))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=spec.name, unit="cell")
        for cell in todo:
            if bar is not None:
                bar.set_postfix_str(f"{cell.metric} {cell.params.get('label', '')} n={cell.params['context_len']}")
            t0 = time.perf_counter()
            rows = RUNNERS[cell.metric](ctx, cell)
            record = {"key": cell.key(digest), "metric": cell.metric, "params": cell.params, "rows": rows,
                      "cell_s": time.perf_counter() - t0, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
                      "git_commit": env.get("git_commit")}
            _append(results, record)
            done[record["key"]] = record
            if bar is not None:
                bar.update(1)
            if on_cell is not None:
                on_cell(cell)
        if bar is not None:
            bar.close()
    records = [done[c.key(digest)] for c in cells if c.key(digest) in done]
    return write_reports(out, spec, records, env)


def format_summary(rows: list[dict]) -> str:
    """Markdown tables of a sweep's rows (quality, ppl, speed, retrieval), for READMEs."""
    lines = []
    q = [r for r in rows if r["metric"] == "quality"]
    from .memory import format_bytes

    if q:
        lines += ["| n | cache | tokens kept | bytes held | vs dense | PPL | PPL full | KL mean | KL p99 | top-1 | top-5 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in q:
            lines.append(f"| {r['context_len']} | {r['label']} | {r.get('budget_tokens') or 'all'} | "
                         f"{format_bytes(r['bytes_held'])} | {r['bytes_vs_dense']:.2f} | {r['ppl']:.2f} | "
                         f"{r['ppl_ref']:.2f} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agreement']:.3f} | "
                         f"{r['top5_agreement']:.3f} |")
        lines.append("")
    p = [r for r in rows if r["metric"] == "ppl"]
    if p:
        lines += ["| n | cache | tokens | PPL | protocol |", "|---|---|---|---|---|"]
        for r in p:
            lines.append(f"| {r['context_len']} | {r['label']} | {r['tokens']} | {r['ppl']:.2f} | {r['protocol']} |")
        lines.append("")
    sp = [r for r in rows if r["metric"] == "speed"]
    if sp:
        lines += ["| n | cache | prefill s | x dynamic | decode ms/token | x dynamic |", "|---|---|---|---|---|---|"]
        for r in sp:
            lines.append(f"| {r['context_len']} | {r['label']} | {r['prefill_s']:.3f} | {r['prefill_ratio']:.2f} | "
                         f"{r['decode_ms_per_token']:.1f} | {r['decode_ratio']:.2f} |")
        lines.append("")
    rt = [r for r in rows if r["metric"] == "retrieval"]
    if rt:
        lines += ["| n | probe | position | cache | exact | JSON parse | value match |", "|---|---|---|---|---|---|---|"]
        for r in rt:
            lines.append(f"| {r['context_len']} | {r['kind']} | {r['position']} | {r['label']} | "
                         f"{r['exact_match']:.2f} | {r['parse_rate']:.2f} | {r['value_match']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
