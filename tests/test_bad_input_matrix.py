"""The bad-input matrix (issue 12): every public argument of every cache, `cache_config` keys through `generate`,
per-layer settings, composite regions and presets, quantization specs and calibration dicts, KVCacheConfig files,
non-finite keys/values and budgets larger than memory, each with the error it must raise.

The cases are data (`CASES`): what is called, the exception type, and a regex the message must match -- it names
the field (and, where the message lists them, the allowed values). Cases on an existing cache (`Stateful`) also
check that the failed call left the cache unchanged: its length and bytes are the same, and the next valid call
gives exactly the logits of a twin cache that never saw the bad call.

docs/bad_inputs.md is generated from this table and the messages raised in this session: the last test renders it
and compares it with the committed file (only when every case ran in this session; it skips otherwise).
`HF_KVCACHE_WRITE_BAD_INPUTS=1` rewrites the file instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import transformers
from conftest import build_config, build_model, random_ids, skip_unless_locked_versions

import hf_kvcache
from hf_kvcache import CACHE_ARG, cache_kwargs
from hf_kvcache.scorers import HEAVY_SCORERS, SCORERS
from hf_kvcache.scorers.registry import options_of
from hf_kvcache.sharing.hub import KVCacheConfig
from hf_kvcache.stores.quantization import NonFiniteError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad_inputs.md"
WRITE = os.environ.get("HF_KVCACHE_WRITE_BAD_INPUTS") == "1"
EXCERPT = 260  # characters of each message in the docs table

CLASSES = {
    "SinkCache": hf_kvcache.SinkCache,
    "SlidingWindowCache": hf_kvcache.SlidingWindowCache,
    "H2OCache": hf_kvcache.H2OCache,
    "RandomEvictionCache": hf_kvcache.RandomEvictionCache,
    "CompositeCache": hf_kvcache.CompositeCache,
    "KnormCache": hf_kvcache.KnormCache,
    "KeyDiffCache": hf_kvcache.KeyDiffCache,
    "SnapKVCache": hf_kvcache.SnapKVCache,
    "KVzipCache": hf_kvcache.KVzipCache,
    "KVzapCache": hf_kvcache.KVzapCache,
    "QuantizedFP8Cache": hf_kvcache.QuantizedFP8Cache,
    "KIVICache": hf_kvcache.KIVICache,
}


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    input: str  # what the user wrote, for the docs table
    run: Callable[[], Any]  # raises the expected error
    error: type
    match: str  # regex searched in the message: names the field (and the allowed values where listed)
    after: Callable[[], None] | None = field(default=None, compare=False)  # state checks after the failed call


_CONFIG = build_config("llama")  # 2 layers, 2 KV heads of head_dim 16, max_position_embeddings 1024


def _kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def ctor(cls: str, error=ValueError, match: str = "", case_id: str | None = None, **kwargs) -> Case:
    text = f"{cls}(config, {_kwargs_text(kwargs)})"
    return Case(
        case_id or f"{cls}-{_kwargs_text(kwargs)}",
        "constructor",
        text,
        lambda: CLASSES[cls](_CONFIG, **kwargs),
        error,
        match,
    )


def region_case(regions, match: str, error=ValueError, **kwargs) -> Case:
    text = f"CompositeCache(config, regions={regions!r}{', ' if kwargs else ''}{_kwargs_text(kwargs)})"
    return Case(
        f"regions-{regions!r}-{_kwargs_text(kwargs)}",
        "composite regions",
        text,
        lambda: hf_kvcache.CompositeCache(_CONFIG, regions=regions, **kwargs),
        error,
        match,
    )


def layers_case(layers, match: str, error=ValueError, cls: str = "SinkCache", config=None, **kwargs) -> Case:
    kwargs = kwargs or {"sinks": 2, "window": 8}
    text = f"{cls}(config, {_kwargs_text(kwargs)}, layers={layers!r})"
    return Case(
        f"layers-{cls}-{layers!r}",
        "layers",
        text,
        lambda: CLASSES[cls](config() if config else _CONFIG, layers=layers, **kwargs),
        error,
        match,
    )


# -- generate(cache_implementation=..., cache_config=...) ------------------------------------------------------------
_MODEL: dict[str, Any] = {}


def model():
    if "llama" not in _MODEL:
        _MODEL["llama"] = build_model("llama")
    return _MODEL["llama"]


def gen_case(name, cache_config, match: str, error=ValueError, **extra) -> Case:
    extra_text = "".join(f", {k}=..." for k in extra)
    text = f"generate(cache_implementation={name!r}, cache_config={cache_config!r}{extra_text})"

    def run():
        m = model()
        kwargs = {k: (v() if callable(v) else v) for k, v in extra.items()}
        m.generate(
            random_ids(1, 4),
            max_new_tokens=2,
            do_sample=False,
            cache_implementation=name,
            cache_config=cache_config,
            **kwargs,
        )

    return Case(f"generate-{name}-{cache_config!r}", "generate cache_config", text, run, error, match)


# -- KVCacheConfig files ------------------------------------------------------------------------------------------
def file_case(
    content: str | bytes, match: str, error=ValueError, name: str = "kvcache_config.json", what: str | None = None
) -> Case:
    shown = what or (content.decode("latin-1") if isinstance(content, bytes) else content)
    text = f"KVCacheConfig.from_pretrained(dir) with {name}: {shown!r}"

    def run():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
            try:
                KVCacheConfig.from_pretrained(tmp)
            except Exception as error:  # the message must name the file it came from
                assert str(path) in str(error) or name in str(error), str(error)
                raise

    return Case(f"file-{name}-{shown!r}", "config files", text, run, error, match)


# -- bad calls on a live cache ------------------------------------------------------------------------------------
def forward(m, cache, ids=None, **kwargs):
    with torch.no_grad():
        return m(ids, **cache_kwargs(cache), use_cache=True, **kwargs).logits


def _state(cache) -> tuple:
    return cache.get_seq_length(), cache.nbytes(), tuple(getattr(layer, "seen", None) for layer in cache.layers)


def stateful(
    case_id: str,
    input_text: str,
    make: Callable,
    bad: Callable,
    error,
    match: str,
    prefix: int = 6,
    next_call: Callable | None = None,
) -> Case:
    """A cache after a valid prompt of `prefix` tokens (none if 0); `bad(model, cache)` must raise, leave the cache's
    state as it was, and the next valid call (`next_call`, default one decode token) must give the logits of a twin
    cache that never saw the bad call."""
    next_call = next_call or (lambda m, cache: forward(m, cache, random_ids(1, 1, seed=9)))
    holder: dict[str, Any] = {}

    def run():
        m = build_model("llama")
        hf_kvcache.enable(m)
        cache, twin = make(m), make(m)
        if prefix:
            ids = random_ids(1, prefix, seed=3)
            forward(m, cache, ids)
            forward(m, twin, ids)
        holder.update(model=m, cache=cache, twin=twin, before=_state(cache))
        bad(m, cache)

    def after():
        m, cache, twin = holder["model"], holder["cache"], holder["twin"]
        assert _state(cache) == holder["before"], "the failed call changed the cache"
        if prefix:  # the stream goes on as if the bad call never happened
            torch.testing.assert_close(next_call(m, cache), next_call(m, twin), rtol=0, atol=0)
        else:  # nothing was allocated: the error came before the buffers
            assert cache.nbytes() == 0 and not any(getattr(layer, "is_initialized", False) for layer in cache.layers)

    return Case(case_id, "live cache", input_text, run, error, match, after)


def non_finite_embeds(m, length=4, where=(0, 1, 3), value=float("inf")):
    embeds = m.model.embed_tokens(random_ids(1, length, seed=5)).detach().clone()
    embeds[where] = value
    return embeds


def huge(param: str, build: Callable, size=10**12) -> Case:
    return stateful(
        f"memory-{param}",
        f"{param} of {size:.0e} tokens, then a 6-token prompt",
        build,
        lambda m, cache: forward(m, cache, random_ids(1, 6)),
        ValueError,
        rf"`{param}`.*at least [\d,]+ bytes.*total memory",
        prefix=0,
    )


def _mistral_sliding():
    return build_config("mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention"])


# -- the `hf-kvcache` command -----------------------------------------------------------------------------------------
class CommandError(Exception):
    """`hf-kvcache ...` exited with a non-zero status; the message is its status and what it printed on stderr."""


def cli_case(argv: list[str], match: str, case_id: str | None = None) -> Case:
    """The command must exit with status 2 and an error naming the flag, before loading any model (a model load
    here is a failure of the case: the loaders are replaced by ones that raise AssertionError)."""
    text = "hf-kvcache " + " ".join(shlex.quote(a) for a in argv)

    def run():
        from hf_kvcache import cli
        from hf_kvcache.cli import eval_commands as eval_cli
        from hf_kvcache.sharing import models

        def no_model(*args, **kwargs):
            raise AssertionError(f"{text} went on to load a model instead of refusing its arguments")

        err = io.StringIO()
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch.object(eval_cli, "_load", no_model),
            mock.patch.object(models, "load_model", no_model),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            try:
                status = cli.main([a.replace("{tmp}", tmp) for a in argv])
            except SystemExit as exit_:
                status = exit_.code
            if status != 0:
                lines = [line for line in err.getvalue().strip().splitlines() if not line.startswith("usage:")]
                raise CommandError(f"exit status {status}: " + " ".join(lines).replace(tmp, "<tmp>"))
        raise AssertionError(f"{text} succeeded")

    return Case(
        case_id or f"cli-{' '.join(argv)}",
        "CLI flags",
        text.replace("{tmp}", "DIR"),
        run,
        CommandError,
        r"exit status 2: .*" + match,
    )


# -- request bodies of hf-kvcache serve (HTTP 400; tests/test_serve_http.py sends them over HTTP) ----------------------
def serve_body_case(endpoint: str, fields: dict, match: str) -> Case:
    from hf_kvcache.paged.serve_requests import RequestRejected, check_body

    base = {"chat_completion": {"messages": [{"role": "user", "content": "hi"}]}, "completion": {"prompt": "hi"}}
    body = {**base[endpoint], **fields}
    path = {"chat_completion": "/v1/chat/completions", "completion": "/v1/completions"}[endpoint]
    return Case(
        f"serve-{endpoint}-{fields!r}",
        "hf-kvcache serve requests (HTTP 400)",
        f"POST {path} {fields!r}",
        lambda: check_body(body, endpoint),
        RequestRejected,
        match,
    )


# -- sweep specs (eval/specs/*.yaml) ---------------------------------------------------------------------------------
_SPEC_BASE = {
    "name": "smoke",
    "model": "smollm2",
    "threads": 1,
    "text": "pydoc",
    "context_lengths": [1024],
    "metrics": ["quality", "speed", "retrieval"],
    "budgets": [0.125, 0.25, 0.5],
    "caches": [
        "dynamic",
        {"name": "sink", "config": {"sinks": 4}, "budget_key": "budget"},
        {"name": "sliding", "budget_key": "window"},
    ],
    "speed": {"decode_tokens": 16, "rounds": 2},
    "retrieval": {"kinds": ["passkey"], "positions": ["early", "late"], "samples": 1, "context_lengths": [1024]},
}


def spec_case(field_path: str, value, match: str, remove: bool = False) -> Case:
    """eval/specs/smoke.yaml-like spec with one field replaced (`a.b.0.c` paths; `remove`: deleted)."""
    from hf_kvcache.evaluation.sweep import SpecError

    def run():
        import copy

        spec = copy.deepcopy(_SPEC_BASE)
        *parents, last = field_path.split(".")
        node = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        key = int(last) if last.isdigit() else last
        if remove:
            del node[key]
        else:
            node[key] = value
        from hf_kvcache.evaluation.sweep import load_spec

        load_spec(spec)

    shown = "removed" if remove else f"{value!r}"
    return Case(
        f"spec-{field_path}-{shown}", "sweep spec fields", f"spec field {field_path}: {shown}", run, SpecError, match
    )


def spec_file_case(content: str, match: str, what: str) -> Case:
    from hf_kvcache.evaluation.sweep import SpecError

    def run():
        from hf_kvcache.evaluation.sweep import load_spec

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.yaml"
            path.write_text(content)
            load_spec(path)

    return Case(
        f"spec-file-{what}", "sweep spec fields", f"hf-kvcache sweep spec.yaml with {what}", run, SpecError, match
    )


# -- cache state files (hf_kvcache.save_cache_state / load_cache_state) ----------------------------------------------
def _saved_state(tmp: str, make=lambda m: hf_kvcache.SinkCache(m, sinks=2, window=4)) -> Path:
    m = model()
    cache = make(m)
    forward(m, cache, random_ids(1, 6))
    path = Path(tmp) / "state.safetensors"
    hf_kvcache.save_cache_state(cache, path)
    return path


def state_case(
    case_id: str,
    what: str,
    damage: Callable[[Path], Any],
    match: str,
    error=ValueError,
    load_kwargs: Callable[[], dict] | None = None,
) -> Case:
    """A state file saved from a SinkCache after 6 tokens, then `damage(path)` (returns the path to load)."""

    def run():
        with tempfile.TemporaryDirectory() as tmp:
            path = damage(_saved_state(tmp)) or _saved_state(tmp)
            kwargs = load_kwargs() if load_kwargs else {}
            config_or_model = kwargs.pop("config_or_model", model())
            hf_kvcache.load_cache_state(path, config_or_model, **kwargs)

    return Case(f"state-{case_id}", "cache state files", what, run, error, match)


def _rewrite_state_header(edit: Callable[[dict], Any]) -> Callable[[Path], Path]:
    def damage(path: Path) -> Path:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not iterable)
            header = json.loads(f.metadata()["hf_kvcache"])
        replaced = edit(header)  # edits in place, or returns the raw header text to write instead
        header = replaced if isinstance(replaced, str) else header
        save_file(
            tensors, str(path), metadata={"hf_kvcache": header if isinstance(header, str) else json.dumps(header)}
        )
        return path

    return damage


def _write_bytes(content: bytes | Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def damage(path: Path) -> Path:
        data = content(path.read_bytes()) if callable(content) else content
        path.write_bytes(data)
        return path

    return damage


def _plain_safetensors(path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"keys": torch.zeros(2)}, str(path))
    return path


CASES: list[Case] = [
    # -- SinkCache -------------------------------------------------------------------------------------------------
    ctor("SinkCache", match=r"`sinks` must be an integer >= 0", sinks=-1, window=8),
    ctor("SinkCache", match=r"`sinks` must be an integer", sinks="4", window=8),
    ctor("SinkCache", match=r"`sinks` must be an integer", sinks=2.5, window=8),
    ctor("SinkCache", match=r"`sinks` must be an integer", sinks=None, window=8),
    ctor("SinkCache", match=r"`window` must be an integer >= 1", sinks=2, window=0),
    ctor("SinkCache", match=r"`window` must be an integer", sinks=2, window=1.5),
    ctor("SinkCache", match=r"`window` must be an integer", sinks=2, window="8"),
    ctor("SinkCache", match=r"`budget` must be an integer >= 1", sinks=0, budget=0),
    ctor("SinkCache", match=r"`budget` must be an integer", sinks=2, budget=True),
    ctor("SinkCache", match=r"exactly one of `window` or `budget`", sinks=2, window=8, budget=10),
    ctor("SinkCache", match=r"`sinks` \(8\) must be smaller than `budget` \(8\)", sinks=8, budget=8),
    ctor(
        "SinkCache",
        match=r"`position_mode` must be one of \('cache', 'original'\)",
        sinks=2,
        window=8,
        position_mode="absolute",
    ),
    ctor(
        "SinkCache",
        match=r"`position_mode` must be one of \('cache', 'original'\)",
        sinks=2,
        window=8,
        position_mode=None,
    ),
    ctor("SinkCache", TypeError, r"'windows'", sinks=2, windows=8),
    # -- SlidingWindowCache --------------------------------------------------------------------------------------------
    ctor("SlidingWindowCache", match=r"`window` must be an integer >= 1", window=-5),
    ctor("SlidingWindowCache", match=r"`window` must be an integer", window=None),
    ctor("SlidingWindowCache", match=r"`window` must be an integer", window=2.0),
    ctor("SlidingWindowCache", match=r"`window` must be an integer", window=[8]),
    ctor("SlidingWindowCache", TypeError, r"'windw'", windw=8),
    # -- H2OCache -----------------------------------------------------------------------------------------------------
    ctor("H2OCache", match=r"`heavy` must be an integer >= 0", heavy=-1, recent=4),
    ctor("H2OCache", match=r"`heavy` as a ratio .* must be in \(0, 1\]", heavy=1.5, recent=4),
    ctor("H2OCache", match=r"`heavy` as a ratio .* must be in \(0, 1\]", heavy=0.0, recent=4),
    ctor("H2OCache", match=r"`recent` must be an integer", heavy=4, recent="4"),
    ctor("H2OCache", match=r"Give `heavy` and `recent`.*`budget`"),
    ctor("H2OCache", match=r"Give `heavy` and `recent`.*`budget`", heavy=4),
    ctor("H2OCache", match=r"`budget` must be an integer >= 1", budget=0),
    ctor("H2OCache", match=r"`budget` must be an integer", budget=8.0),
    ctor("H2OCache", match=r"`head_budget` must be one of .*'adaptive'", budget=8, head_budget="per_head"),
    ctor("H2OCache", match=r"`safeguard` .* must be in \[0, 1\]", budget=8, head_budget="adaptive", safeguard=1.5),
    ctor(
        "H2OCache",
        match=r"`position_mode` 'compact' .* 'adaptive'",
        budget=8,
        position_mode="compact",
        head_budget="adaptive",
    ),
    ctor(
        "H2OCache",
        match=r"`attention_score` must be one of \('accumulated', 'average'\)",
        budget=8,
        attention_score="mean",
    ),
    ctor("KeyDiffCache", match=r"`rescore_every` must be an integer >= 1", budget=8, rescore_every=0),
    ctor("SnapKVCache", match=r"`rescore_every` must be an integer", budget=80, rescore_every=2.5),
    ctor("KVzipCache", match=r"`compress` must be one of \('prompt',\)", budget=8, compress="always"),
    ctor(
        "KVzipCache", match=r"`layer_budget` must be one of \('uniform', 'adaptive'\)", budget=8, layer_budget="global"
    ),
    ctor("KVzipCache", match=r"`request_ids` must be a dict with the keys", budget=8, request_ids={"first": [1]}),
    ctor("KVzipCache", match=r"`chunk_size` must be an integer >= 1", budget=8, chunk_size=0),
    ctor("KVzipCache", match=r"`precision`.*format", budget=8, precision="fp7"),
    ctor(
        "KVzipCache",
        match=r"`precision\['values'\]`.*granularity 'token'",
        budget=8,
        precision={"keys": "fp8_e4m3", "values": {"format": "int4", "granularity": "channel"}},
    ),
    ctor("KVzapCache", match=r"`surrogate` must be a Surrogate, a directory", budget=8, surrogate=3),
    ctor("KVzapCache", match=r"`compress` must be one of \('prompt', 'always'\)", budget=8, compress="never"),
    ctor("KVzapCache", match=r"`recent` must be an integer >= 0", budget=8, recent=-1),
    ctor("KnormCache", match=r"`recent` must be an integer >= 0", budget=8, recent=-1),
    ctor("H2OCache", match=r"`budget` is a token count.*not ratios", budget=8, heavy=0.5),
    ctor("H2OCache", match=r"`heavy` \+ `recent` \(6 \+ 6\) must fit in `budget` \(8\)", budget=8, heavy=6, recent=6),
    ctor("H2OCache", match=r"`heavy` \+ `recent` must be at least 1", heavy=0, recent=0),
    ctor(
        "H2OCache",
        match=r"`aggregation` must be one of \('sum', 'mean', 'max'\)",
        heavy=4,
        recent=4,
        aggregation="median",
    ),
    ctor(
        "H2OCache",
        match=r"`position_mode` must be one of \('original', 'compact'\)",
        heavy=4,
        recent=4,
        position_mode="cache",
    ),
    # -- RandomEvictionCache ------------------------------------------------------------------------------------------
    ctor("RandomEvictionCache", match=r"`seed` must be an integer >= 0", heavy=2, recent=2, seed=-1),
    ctor("RandomEvictionCache", match=r"`seed` must be an integer", heavy=2, recent=2, seed=1.5),
    ctor("RandomEvictionCache", match=r"`seed` must be an integer", heavy=2, recent=2, seed="0"),
    ctor("RandomEvictionCache", match=r"`heavy` as a ratio", heavy=2.0, recent=2),
    ctor("RandomEvictionCache", match=r"must fit in `budget` \(8\)", budget=8, heavy=9),
    ctor("RandomEvictionCache", match=r"Give `heavy` and `recent`", recent=3),
    ctor("RandomEvictionCache", TypeError, r"'aggregation'", heavy=2, recent=2, aggregation="sum"),
    # -- CompositeCache: arguments and presets ------------------------------------------------------------------------
    ctor("CompositeCache", match=r"exactly one of `regions` or `preset`.*sinks_heavy_recent"),
    ctor(
        "CompositeCache",
        match=r"exactly one of `regions` or `preset`",
        regions=[{"role": "window", "start": 0, "end": 8}],
        preset="sinks_heavy_recent",
        budget=64,
    ),
    ctor("CompositeCache", match=r"`preset` must be one of \('sinks_heavy_recent',\)", preset="h2o", budget=64),
    ctor("CompositeCache", match=r"`preset` 'sinks_heavy_recent' needs a token `budget`", preset="sinks_heavy_recent"),
    ctor("CompositeCache", match=r"`budget` must be an integer >= 6", preset="sinks_heavy_recent", budget=5),
    ctor("CompositeCache", match=r"`budget` must be an integer", preset="sinks_heavy_recent", budget=64.0),
    ctor(
        "CompositeCache",
        match=r"`budget` is for presets",
        regions=[{"role": "window", "start": 0, "end": 8}],
        budget=64,
    ),
    ctor(
        "CompositeCache",
        match=r"`precision`.*`format` must be one of \('fp8_e4m3', 'fp8_e5m2', 'int8', 'int4', "
        r"'int2', 'none'\)",
        preset="sinks_heavy_recent",
        budget=64,
        precision="fp7",
    ),
    ctor(
        "CompositeCache",
        match=r"`aggregation` must be one of \('sum', 'mean', 'max'\)",
        regions=[{"role": "window", "start": 0, "end": 8}],
        aggregation="avg",
    ),
    ctor(
        "CompositeCache",
        match=r"`sink_positions` must be one of \('cache', 'original'\)",
        regions=[{"role": "window", "start": 0, "end": 8}],
        sink_positions="absolute",
    ),
    ctor(
        "CompositeCache",
        match=r"`scorer` must be one of " + re.escape(str(HEAVY_SCORERS)) + ", got 'pyramidkv'",
        preset="sinks_heavy_recent",
        budget=64,
        scorer="pyramidkv",
    ),
    ctor(
        "CompositeCache",
        match=r"`scorer` 'kvzap' is driven by its own cache .*cache_implementation='kvzap' with `precision`",
        preset="sinks_heavy_recent",
        budget=64,
        scorer="kvzap",
    ),
    ctor(
        "CompositeCache",
        match=r"scorer 'snapkv' needs `budget` >= 132 .*got 64",
        preset="sinks_heavy_recent",
        budget=64,
        scorer="snapkv",
    ),
    ctor(
        "CompositeCache",
        match=r"`scorer` is for presets; with `regions`, give it in the heavy region",
        regions=[{"role": "window", "start": 0, "end": 8}],
        scorer="tova",
    ),
    # -- CompositeCache: regions and their fields ---------------------------------------------------------------------
    region_case([], r"`regions` must be a non-empty list"),
    region_case("window", r"`regions` must be a non-empty list"),
    region_case([["window", 0, 8]], r"regions\[0\] must be a dict, got list"),
    region_case(
        [{"start": 0, "end": 8}], r"`regions\[0\]\.role` must be one of \('sinks', 'window', 'heavy', 'rest'\)"
    ),
    region_case([{"role": "recent", "start": 0, "end": 8}], r"`regions\[0\]\.role` must be one of \('sinks', 'window'"),
    region_case([{"role": "window", "end": 8}], r"`regions\[0\]\.start` must be an integer >= 0"),
    region_case([{"role": "window", "start": -1, "end": 8}], r"`regions\[0\]\.start` must be an integer >= 0"),
    region_case([{"role": "window", "start": 0, "end": 2.5}], r"`regions\[0\]\.end` must be an integer"),
    region_case(
        [{"role": "window", "start": 8, "end": 8}], r"regions\[0\]: `end` \(8\) must be larger than `start` \(8\)"
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "window", "start": 10, "end": 16}],
        r"regions\[1\]: window starts at 10 .* a gap of 2 tokens",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "window", "start": 4, "end": 16}],
        r"regions\[1\]: window \[4, 16\) overlaps",
    ),
    region_case([{"role": "window", "start": 4, "end": 8}], r"regions\[0\]: window starts at 4 .* gap"),
    region_case([{"role": "sinks", "tokens": 4}], r"needs at least one 'window' region"),
    region_case(
        [{"role": "sinks", "tokens": 4}, {"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 8}],
        r"regions\[1\]: only one 'sinks' region",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4}, {"role": "rest"}],
        r"regions\[2\]: only one of 'heavy' or 'rest'",
    ),
    region_case(
        [{"role": "sinks", "tokens": 0}, {"role": "window", "start": 0, "end": 8}],
        r"`regions\[0\]\.tokens` must be an integer >= 1",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy"}], r"`regions\[1\]\.tokens` must be an integer"
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8, "size": 8}],
        r"Unknown regions\[0\] \(window\) key\(s\) \['size'\]; "
        r"valid keys are \['end', 'keys', 'role', 'start', 'values'\]",
    ),
    region_case(
        [{"role": "sinks", "tokens": 4, "start": 0}, {"role": "window", "start": 0, "end": 8}],
        r"Unknown regions\[0\] \(sinks\) key\(s\) \['start'\]",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "rest", "tokens": 4}],
        r"Unknown regions\[1\] \(rest\) key\(s\) \['tokens'\]",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8, "keys": "fp9"}],
        r"regions\[0\]\.keys.*`format` must be one of \('fp8_e4m3'",
    ),
    region_case([{"role": "window", "start": 0, "end": 8, "values": 8}], r"regions\[0\]\.values must be a format name"),
    region_case(
        [{"role": "window", "start": 0, "end": 8, "values": {"format": "int4", "granularity": "channel"}}],
        r"regions\[0\]\.values: granularity 'channel' needs the append-only",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8, "keys": {"format": "int8", "bits": 8}}],
        r"Unknown regions\[0\]\.keys key\(s\) \['bits'\]",
    ),
    # the heavy region's scorer and prompt mode (issue 14)
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4, "scorer": "pyramidkv"}],
        r"`regions\[1\]\.scorer` must be one of " + re.escape(str(HEAVY_SCORERS)) + ", got 'pyramidkv'",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4, "scorer": "kvzip"}],
        r"`regions\[1\]\.scorer` 'kvzip' is driven by its own cache .*cache_implementation='kvzip' with `precision`",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4, "scorer": "snapkv"}],
        r"regions\[1\]\.window \(64\) must not exceed the window regions' span \(8 tokens\)",
    ),
    region_case(
        [
            {"role": "window", "start": 0, "end": 8},
            {"role": "heavy", "tokens": 4, "scorer": "snapkv", "window": 8, "kernel": 4},
        ],
        r"`regions\[1\]\.kernel` must be odd",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4, "window": 4}],
        r"regions\[1\]\.window is an option of scorer 'snapkv' only",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "heavy", "tokens": 4}],
        r"`compress` must be one of \('always', 'prompt'\), got 'decode'",
        compress="decode",
    ),
    region_case(
        [{"role": "window", "start": 0, "end": 8}, {"role": "rest"}],
        r"compress='prompt': regions\[1\] \('rest'\) keeps every token already",
        compress="prompt",
    ),
    # -- QuantizedFP8Cache ---------------------------------------------------------------------------------------------
    ctor("QuantizedFP8Cache", match=r"`format` must be one of \('fp8_e4m3', 'fp8_e5m2', 'int8'", format="fp16"),
    ctor(
        "QuantizedFP8Cache",
        match=r"`granularity` must be one of \('tensor', 'head', 'token', 'channel'\)",
        granularity="block",
    ),
    ctor("QuantizedFP8Cache", match=r"`group_size` must be an integer >= 1", group_size=0),
    ctor("QuantizedFP8Cache", match=r"`group_size` \(7\) must divide the model's head_dim \(16\)", group_size=7),
    ctor(
        "QuantizedFP8Cache", match=r"`group_size` must be None for granularity 'head'", granularity="head", group_size=4
    ),
    ctor("QuantizedFP8Cache", match=r"`residual` must be an integer >= 0", residual=-1),
    ctor("QuantizedFP8Cache", match=r"`residual` must be an integer", residual=1.5),
    ctor("QuantizedFP8Cache", match=r"`key_smoothing` must be a bool", key_smoothing="yes"),
    ctor("QuantizedFP8Cache", match=r"`key_rotation` must be one of \(.*'hadamard'.*'auto'\)", key_rotation="dct"),
    ctor("QuantizedFP8Cache", match=r"`max_length` must be an integer >= 1", max_length=0),
    ctor("QuantizedFP8Cache", match=r"`max_length` must be an integer", max_length="1024"),
    ctor("QuantizedFP8Cache", match=r"`max_length` .* needs residual=0 .*got residual=4", max_length=16, residual=4),
    ctor(
        "QuantizedFP8Cache",
        match=r"`max_length` .* granularity 'token', 'head' or 'tensor'.*'channel'",
        max_length=16,
        granularity="channel",
    ),
    ctor("QuantizedFP8Cache", match=r"`attention` must be one of \(.*'blockwise'.*\)", attention="flash"),
    ctor("QuantizedFP8Cache", match=r"`attention_block` must be an integer >= 1", attention_block=0),
    ctor("QuantizedFP8Cache", match=r"`key` must be a dict of QuantSpec fields, got str", key="int8"),
    ctor("QuantizedFP8Cache", match=r"`value` must be a dict of QuantSpec fields, got list", value=["int8"]),
    ctor(
        "QuantizedFP8Cache",
        match=r"Unknown `key` spec key\(s\) \['fmt'\]; valid keys are \['backend'",
        key={"fmt": "int8"},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"backend 'torch' does not support format 'int4': it supports .* use backend "
        r"'quanto' or 'hqq'",
        value={"format": "int4", "backend": "torch"},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`granularity` for integer format 'int8' must be one of \('token', 'channel'\)",
        key={"format": "int8", "granularity": "head"},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`scale_dtype` must be one of \('float32', 'float16', 'bfloat16', 'e8m0'\)",
        key={"scale_dtype": "float64"},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`scale_dtype` applies to integer formats and to FP8 'token'/'channel'",
        granularity="head",
        value={"scale_dtype": "float16"},
    ),
    ctor(
        "QuantizedFP8Cache", match=r"`backend` must be one of \('torch', 'quanto', 'hqq'\)", key={"backend": "triton"}
    ),
    ctor("QuantizedFP8Cache", match=r"`group_size` must be an integer", value={"group_size": "4"}),
    ctor(
        "QuantizedFP8Cache",
        match=r"value: head_dim \(16\) must be a multiple|`group_size` \(32\) must divide",
        value={"format": "int4", "group_size": 32},
    ),
    # -- QuantizedFP8Cache: calibration dicts (scales) ---------------------------------------------------------------
    ctor("QuantizedFP8Cache", match=r"`scales` must be a calibration dict", granularity="head", scales="calib.json"),
    ctor(
        "QuantizedFP8Cache",
        match=r"Unknown `scales` \(calibration dict\) key\(s\) \['foo'\]",
        granularity="head",
        scales={"foo": 1},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`scales` was calibrated for num_layers=5, this model has 2",
        granularity="head",
        scales={"num_layers": 5},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`scales` was calibrated for head_dim=64, this model has 16",
        granularity="head",
        scales={"head_dim": 64},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"scales\['key_scale'\] must be a list of 2 per-layer lists",
        granularity="head",
        key_rotation="none",
        scales={"format": "fp8_e4m3", "key_scale": [[1.0, 1.0]]},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"scales\['value_scale'\]\[1\] must be a list of 2 numbers",
        granularity="head",
        scales={"format": "fp8_e4m3", "value_scale": [[1.0, 1.0], [1.0, "x"]]},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"value scales calibrated for format 'fp8_e5m2'.*calibrate with "
        r"format='fp8_e4m3'",
        granularity="head",
        scales={"format": "fp8_e5m2", "value_scale": [[1.0, 1.0]] * 2},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"key scales calibrated with key_rotation='none'.*key_rotation='hadamard'",
        granularity="head",
        scales={"format": "fp8_e4m3", "key_scale": [[1.0, 1.0]] * 2},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"`scales` was given but nothing uses it",
        scales={"format": "fp8_e4m3", "key_scale": [[1.0, 1.0]] * 2},
    ),
    ctor(
        "QuantizedFP8Cache",
        match=r"scales\['key_mean'\]\[0\] must be \[2\]\[16\]",
        key_smoothing=True,
        key_rotation="none",
        scales={"key_mean": [[[0.0] * 16], [[0.0] * 16] * 2]},
    ),
    # -- KIVICache -----------------------------------------------------------------------------------------------------
    ctor("KIVICache", match=r"`bits` must be one of \(2, 4, 8\), got 3", bits=3),
    ctor("KIVICache", match=r"`bits` must be one of \(2, 4, 8\), got True", bits=True),
    ctor("KIVICache", match=r"`bits` must be one of \(2, 4, 8\)", bits="4"),
    ctor("KIVICache", match=r"`group_size` must be an integer >= 1", group_size=0),
    ctor("KIVICache", match=r"`value_group_size` must be an integer >= 1", value_group_size=-2),
    ctor("KIVICache", match=r"`group_size` \(5\) must divide the model's head_dim \(16\)", value_group_size=5),
    ctor(
        "KIVICache", match=r"`backend` must be one of \('quanto', 'hqq', 'torch'\)", backend="bnb", value_group_size=16
    ),
    ctor("KIVICache", match=r"backend 'torch' does not support format 'int4'", backend="torch", value_group_size=16),
    ctor("KIVICache", match=r"`residual` must be an integer >= 0", residual=-1, value_group_size=16),
    ctor(
        "KIVICache",
        match=r"`scale_dtype` must be one of \('float32', 'float16', 'bfloat16'\)",
        scale_dtype="float64",
        value_group_size=16,
    ),
    ctor("KIVICache", match=r"`key_smoothing` must be a bool", key_smoothing=1, value_group_size=16),
    ctor("KIVICache", match=r"`key_rotation` must be one of", key_rotation="rotate", value_group_size=16),
    ctor("KIVICache", match=r"`attention` must be one of", attention="flash", value_group_size=16),
    ctor("KIVICache", match=r"`attention_block` must be an integer >= 1", attention_block=-1, value_group_size=16),
    # -- the first argument -------------------------------------------------------------------------------------------
    Case(
        "first-argument-string",
        "constructor",
        "SinkCache('meta-llama/Llama-2-7b', sinks=2, window=8)",
        lambda: hf_kvcache.SinkCache("meta-llama/Llama-2-7b", sinks=2, window=8),
        ValueError,
        r"first argument must be a transformers model or its config, got str",
    ),
    Case(
        "first-argument-fp8-dict",
        "constructor",
        "QuantizedFP8Cache({'num_hidden_layers': 2})",
        lambda: hf_kvcache.QuantizedFP8Cache({"num_hidden_layers": 2}),
        ValueError,
        r"first argument must be a transformers model or its config, got dict",
    ),
    Case(
        "encoder-decoder",
        "constructor",
        "SlidingWindowCache(T5Config(), window=8)",
        lambda: hf_kvcache.SlidingWindowCache(transformers.T5Config(), window=8),
        ValueError,
        r"encoder-decoder",
    ),
    # -- generate(cache_implementation=..., cache_config=...) ----------------------------------------------------------
    gen_case(
        "sink",
        {"windows": 8},
        r"Unknown cache_config for cache_implementation='sink' key\(s\) \['windows'\]; "
        r"valid keys are \['budget', 'compress', 'layers', 'position_mode', 'sinks', 'window'\]",
    ),
    gen_case("sink", {"window": 0}, r"`window` must be an integer >= 1"),
    gen_case("sink", {"sinks": 8, "budget": 8}, r"`sinks` \(8\) must be smaller than `budget` \(8\)"),
    gen_case("sliding", {"window": "8"}, r"`window` must be an integer"),
    gen_case("h2o", {"heavy": 2.0, "recent": 4}, r"`heavy` as a ratio"),
    gen_case("h2o", {"budget": 8, "heavy": 0.5}, r"`budget` is a token count"),
    gen_case("h2o", {"aggregation": "median"}, r"`aggregation` must be one of \('sum', 'mean', 'max'\)"),
    gen_case("random_eviction", {"seed": -1}, r"`seed` must be an integer >= 0"),
    gen_case("composite", {"regions": [{"role": "window", "start": 0}]}, r"`regions\[0\]\.end` must be an integer"),
    gen_case("composite", {"preset": "x"}, r"`preset` must be one of \('sinks_heavy_recent',\)"),
    gen_case(
        "composite", {"regions": [{"role": "window", "start": 0, "end": 8}], "budget": 8}, r"`budget` is for presets"
    ),
    gen_case("fp8", {"format": "int3"}, r"`format` must be one of \('fp8_e4m3'"),
    gen_case("fp8", {"max_length": 8, "residual": 2}, r"`max_length` .* needs residual=0"),
    gen_case("kivi", {"bits": 5}, r"`bits` must be one of \(2, 4, 8\)"),
    gen_case("kivi", {"backend": "gptq"}, r"`backend` must be one of"),
    gen_case("sink", {"layers": {"9": "keep"}, "window": 8}, r"`layers` key '9': layer index must be in 0\.\.1"),
    gen_case(
        "sink",
        {"window": 8},
        rf"Passing both `cache_implementation`.*`{CACHE_ARG}`",
        **cache_kwargs(lambda: hf_kvcache.SinkCache(_CONFIG, sinks=2, window=8)),
    ),
    # -- per-layer settings (layers=) ----------------------------------------------------------------------------------
    layers_case([None], r"`layers` as a list needs one entry per decoder layer \(2\), got 1"),
    layers_case({"5": "keep"}, r"`layers` key '5': layer index must be in 0\.\.1"),
    layers_case({-1: "keep"}, r"`layers` key -1: layer index must be in 0\.\.1"),
    layers_case({1.5: "keep"}, r"`layers` key 1\.5 \(float\) must be a layer type or a layer index 0\.\.1"),
    layers_case({True: "keep"}, r"`layers` key True \(bool\) must be a layer type or a layer index"),
    layers_case(
        {"sliding_attention": "keep"},
        r"`layers` key 'sliding_attention' is not a layer type of this model; "
        r"its layer types are \['full_attention'\]",
    ),
    layers_case({"0": "drop"}, r"layers\['0'\] must be one of \('keep', 'default'\) or a dict of settings"),
    layers_case([{"windw": 4}, None], r"Unknown layers\[0\] settings for 'sink' key\(s\) \['windw'\]; valid keys"),
    layers_case(
        {"1": {"cache": "lru"}}, r"layers\[1\]: `cache` must be one of \['composite', 'expected_attention', 'fp8'"
    ),
    layers_case({"0": {"window": 0}}, r"`window` must be an integer >= 1"),
    layers_case([{"cache": "fp8", "format": "x"}, None], r"`format` must be one of"),
    layers_case([{"cache": "fp8", "max_length": 4, "residual": 1}, None], r"`max_length` .* needs residual=0"),
    layers_case(5, r"`layers` must be a dict \(by layer type or index\) or a list .*got int"),
    layers_case("keep", r"`layers` must be a dict .*got str"),
    layers_case(
        {"sliding_attention": {"window": 4}},
        r"layers\['sliding_attention'\]: layer 0 is a "
        r"'sliding_attention' layer.*settings apply to 'full_attention' layers only",
        config=_mistral_sliding,
    ),
    layers_case({"full_attention": {"heavy": 2.0}}, r"`heavy` as a ratio", cls="H2OCache", heavy=4, recent=4),
    # -- KVCacheConfig files -------------------------------------------------------------------------------------------
    file_case("", r"kvcache_config\.json is empty; expected a JSON object"),
    file_case("{", r"kvcache_config\.json is truncated \(the JSON ends early\)"),
    file_case('{"cache": "sink", "config": {"window": 8}', r"is truncated \(the JSON ends early\)"),
    file_case('{"cache": "sink", "config": {"window": 8}}}', r"is not valid JSON: Extra data"),
    file_case("cache: sink\nconfig:\n  window: 8\n", r"is not valid JSON: Expecting value at line 1"),
    file_case(b"\xff\xfe{\x00}\x00", r"is not a JSON text file \(not UTF-8: byte 0 is 0xff\)", what="UTF-16 bytes"),
    file_case("[1, 2]", r"must be a JSON object with fields \['cache', 'config', 'version'\], got list"),
    file_case('{"cache": "sink", "config": {"window": NaN}}', r"NaN is not valid JSON \(JSON has no NaN or Infinity\)"),
    file_case('{"cache": "sink", "cache": "sliding"}', r"key 'cache' appears twice in the same JSON object"),
    file_case(
        '{"config": {"window": 8}}',
        r"missing field 'cache' \(the cache name, one of \['composite', 'expected_attention', 'fp8'",
    ),
    file_case(
        '{"cache": "lru"}',
        r"`cache` must be one of " + re.escape(str(sorted(hf_kvcache.CACHE_IMPLEMENTATIONS))) + ", got 'lru'",
    ),
    file_case(
        '{"cache": "sink", "config": {"window": 8}, "extra": 1}',
        r"unknown field\(s\) \['extra'\]; valid fields "
        r"are \['cache', 'config', 'version', 'hf_kvcache_version'\]",
    ),
    file_case('{"cache": "sink", "config": {"window": 8}, "version": 99}', r"version.*99"),
    file_case('{"cache": "sink", "config": {"window": 8}, "version": "1"}', r"version"),
    file_case('{"cache": "sink", "config": {"window": -1}}', r"kvcache_config\.json.*`window` must be an integer >= 1"),
    file_case('{"cache": "sink", "config": [8]}', r"config"),
    file_case('{"cache": "sink", "config": {"windw": 8}}', r"Unknown cache_config .* key\(s\) \['windw'\]; valid keys"),
    file_case('{"cache": "sink", "hf_kvcache_version": 3}', r"`hf_kvcache_version` must be a string, got 3"),
    file_case('{"cache_implementation": "sink", "cache_config": {"window": "x"}}', r"`window` must be an integer"),
    file_case(
        '{"hf_kvcache": {"cache": "sliding", "config": {"window": 0}}}',
        r"key 'hf_kvcache'.*`window` must be "
        r"an integer >= 1",
        name="generation_config.json",
    ),
    file_case(
        '{"hf_kvcache": {"cache": "sliding", "config": {"window": 8}',
        r"generation_config\.json is truncated",
        name="generation_config.json",
    ),
    # -- live caches: the failed call leaves the cache unchanged and the next call works -------------------------------
    stateful(
        "non-finite-fp8-prefill",
        "QuantizedFP8Cache: a prompt chunk whose keys/values hold inf",
        lambda m: hf_kvcache.QuantizedFP8Cache(m),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m)),
        NonFiniteError,
        r"QuantizedFP8Cache \(layer 0\): \d+ non-finite keys, \d+ non-finite values .* left unchanged",
    ),
    stateful(
        "non-finite-fp8-decode",
        "QuantizedFP8Cache: a decode token whose keys/values are NaN",
        lambda m: hf_kvcache.QuantizedFP8Cache(m),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m, 1, (0, 0, 5), float("nan"))),
        NonFiniteError,
        r"layer 0\): 32 non-finite keys, 32 non-finite values among .*inf/NaN cannot be quantized",
    ),
    stateful(
        "non-finite-fp8-max-length",
        "QuantizedFP8Cache(max_length=32): inf keys/values in decode",
        lambda m: hf_kvcache.QuantizedFP8Cache(m, max_length=32),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m, 1, (0, 0, 1))),
        NonFiniteError,
        r"non-finite keys",
    ),
    stateful(
        "non-finite-fp8-residual",
        "QuantizedFP8Cache(residual=2): inf in a prompt chunk",
        lambda m: hf_kvcache.QuantizedFP8Cache(m, residual=2),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m)),
        NonFiniteError,
        r"non-finite keys",
    ),
    stateful(
        "non-finite-kivi",
        "KIVICache(group_size=4, residual=4): inf in a prompt chunk",
        lambda m: hf_kvcache.KIVICache(m, group_size=4, value_group_size=4, residual=4),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m, 8, (0, 1))),
        NonFiniteError,
        r"KIVICache \(layer 0\): \d+ non-finite keys",
    ),
    stateful(
        "non-finite-composite",
        "CompositeCache with an FP8 window: inf in a prompt chunk",
        lambda m: hf_kvcache.CompositeCache(
            m,
            regions=[
                {"role": "sinks", "tokens": 2},
                {"role": "window", "start": 0, "end": 16, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
            ],
        ),
        lambda m, c: forward(m, c, inputs_embeds=non_finite_embeds(m)),
        NonFiniteError,
        r"regions\[1\].*non-finite keys",
    ),
    stateful(
        "batch-size-change-sink",
        "SinkCache: a forward with 2 rows after a 1-row prompt",
        lambda m: hf_kvcache.SinkCache(m, sinks=2, window=8),
        lambda m, c: forward(m, c, random_ids(2, 1)),
        ValueError,
        r"batch of 1 rows, but the forward gave 2: the batch size cannot change .*`cache\.reset\(\)`",
    ),
    stateful(
        "batch-size-change-h2o",
        "H2OCache: a 3-row chunk after a 1-row prompt",
        lambda m: hf_kvcache.H2OCache(m, heavy=2, recent=2),
        lambda m, c: forward(m, c, random_ids(3, 2)),
        ValueError,
        r"batch of 1 rows, but the forward gave 3",
    ),
    stateful(
        "batch-size-change-fp8",
        "QuantizedFP8Cache: a 2-row token after a 1-row prompt",
        lambda m: hf_kvcache.QuantizedFP8Cache(m),
        lambda m, c: forward(m, c, random_ids(2, 1)),
        ValueError,
        r"batch of 1 rows, but the forward gave 2",
    ),
    stateful(
        "max-length-overflow",
        "QuantizedFP8Cache(max_length=8): a 4-token chunk after 6 tokens",
        lambda m: hf_kvcache.QuantizedFP8Cache(m, max_length=8),
        lambda m, c: forward(m, c, random_ids(1, 4)),
        ValueError,
        r"`max_length` is 8 tokens; this forward would make it 10",
    ),
    stateful(
        "crop-positive",
        "SinkCache: crop(3)",
        lambda m: hf_kvcache.SinkCache(m, sinks=2, window=16),
        lambda m, c: c.crop(3),
        ValueError,
        r"negative",
    ),
    stateful(
        "crop-after-eviction",
        "SinkCache(2 + 2): crop(-1) after 6 tokens",
        lambda m: hf_kvcache.SinkCache(m, sinks=2, window=2),
        lambda m, c: c.crop(-1),
        ValueError,
        r"evict",
    ),
    stateful(
        "mask-3d",
        "SinkCache: a 3-D attention_mask",
        lambda m: hf_kvcache.SinkCache(m, sinks=2, window=16),
        lambda m, c: forward(m, c, random_ids(1, 2), attention_mask=torch.ones(1, 8, 8)),
        ValueError,
        r"2-D `attention_mask`.*got 3-D",
    ),
    stateful(
        "mask-too-short",
        "SinkCache: an attention_mask with fewer columns than new tokens",
        lambda m: hf_kvcache.SinkCache(m, sinks=2, window=16),
        lambda m, c: forward(m, c, random_ids(1, 3), attention_mask=torch.ones(1, 2, dtype=torch.long)),
        ValueError,
        r"`attention_mask` has 2 columns, fewer than the 3 new tokens",
    ),
    # -- budgets larger than memory: refused before allocating, with the bytes ----------------------------------------
    huge("window", lambda m: hf_kvcache.SlidingWindowCache(m, window=10**12)),
    huge("budget", lambda m: hf_kvcache.SinkCache(m, sinks=4, budget=10**12)),
    huge("heavy", lambda m: hf_kvcache.H2OCache(m, heavy=10**12, recent=4)),
    huge("recent", lambda m: hf_kvcache.RandomEvictionCache(m, heavy=4, recent=10**12)),
    huge("max_length", lambda m: hf_kvcache.QuantizedFP8Cache(m, max_length=10**12)),
    huge("regions", lambda m: hf_kvcache.CompositeCache(m, regions=[{"role": "window", "start": 0, "end": 10**12}])),
    # -- the hf-kvcache command: exit status 2, the flag named, no model loaded ----------------------------------------
    cli_case(
        ["ppl", "--cache", "lru"], r"--cache lru: unknown cache 'lru'; valid names are hf_kvcache caches \['composite'"
    ),
    cli_case(
        ["ppl", "--cache", "sink:windw=8"],
        r"--cache sink: unknown key\(s\) \['windw'\] for cache 'sink'; "
        r"valid keys are \['budget'",
    ),
    cli_case(
        ["ppl", "--cache", "sink:sinks"], r"--cache 'sink:sinks': expected key=value pairs after ':', got 'sinks'"
    ),
    cli_case(["ppl", "--cache", "sink:{bad json"], r"--cache 'sink:\{bad json': the config is not valid JSON"),
    cli_case(
        ["ppl", "--cache", "sink:sinks=4,budget=0"],
        r"--cache sink\.budget: a budget is a number of tokens "
        r"\(integer >= 1\) or a fraction of the context",
    ),
    cli_case(
        ["ppl", "--cache", "sink:sinks=4,budget=150%"],
        r"--cache sink\.budget: a budget fraction must be in "
        r"\(0, 1\]",
    ),
    cli_case(
        ["ppl", "--cache", "h2o:aggregation=median,budget=8"],
        r"--cache h2o: .*`aggregation` must be one of "
        r"\('sum', 'mean', 'max'\), got 'median'",
    ),
    cli_case(["ppl", "--cache", "sink:sinks=8,budget=8"], r"`sinks` \(8\) must be smaller than `budget` \(8\)"),
    cli_case(["ppl", "--tokens", "0"], r"argument --tokens: expected a positive integer, got 0"),
    cli_case(["ppl", "--tokens", "abc"], r"argument --tokens: expected a positive integer, got 'abc'"),
    cli_case(["ppl", "--mode", "fast"], r"argument --mode: invalid choice: 'fast' \(choose from 'stream', 'chunked'\)"),
    cli_case(
        ["ppl", "--dtype", "float64"],
        r"argument --dtype: invalid choice: 'float64' \(choose from 'float32', "
        r"'bfloat16', 'float16'\)",
    ),
    cli_case(["ppl", "--chunk", "-3"], r"argument --chunk: expected a positive integer, got -3"),
    cli_case(["ppl", "--threads", "0"], r"argument --threads: expected a positive integer, got 0"),
    cli_case(["ppl", "--offset", "-5"], r"argument --offset: expected an integer >= 0, got -5"),
    cli_case(["ppl", "--context", "0"], r"argument --context: expected a positive integer, got 0"),
    cli_case(["ppl", "--model", "./no-such-model"], r"--model './no-such-model': no such model directory"),
    cli_case(
        ["ppl", "--text", "/no/such/text.txt"],
        r"--text '/no/such/text\.txt': not 'pydoc', 'hf:DATASET' or an "
        r"existing text file",
    ),
    cli_case(["divergence", "--top-k", "0"], r"argument --top-k: expected a positive integer, got 0"),
    cli_case(["divergence", "--prompt-tokens", "x"], r"argument --prompt-tokens: expected a positive integer, got 'x'"),
    cli_case(["divergence", "--prefill-chunk", "0"], r"argument --prefill-chunk: expected a positive integer, got 0"),
    cli_case(["divergence", "--cache", "kivi:bits=3"], r"`bits` must be one of \(2, 4, 8\), got 3"),
    cli_case(
        ["retrieval", "--kinds", "passkey,needle"],
        r"--kinds: unknown probe 'needle'; valid probes are "
        r"\['passkey', 'records'\]",
    ),
    cli_case(
        ["retrieval", "--positions", "early,top"],
        r"--positions: each entry must be one of \['early', 'middle', "
        r"'late'\] or a depth in \[0, 1\], got 'top'",
    ),
    cli_case(["retrieval", "--positions", "1.5"], r"--positions: .* or a depth in \[0, 1\], got '1\.5'"),
    cli_case(
        ["retrieval", "--context-lengths", "2048,abc"],
        r"--context-lengths: comma-separated token counts, "
        r"expected a positive integer, got 'abc'",
    ),
    cli_case(["retrieval", "--context-lengths", "0"], r"--context-lengths: .*expected a positive integer, got 0"),
    cli_case(["retrieval", "--samples", "0"], r"argument --samples: expected a positive integer, got 0"),
    cli_case(["speed", "--rounds", "0"], r"argument --rounds: expected a positive integer, got 0"),
    cli_case(["speed", "--decode-tokens", "-1"], r"argument --decode-tokens: expected a positive integer, got -1"),
    cli_case(["memory", "--shapes", "gpt-9"], r"Unknown model shape 'gpt-9'; known shapes are \['deepseek-v3'"),
    cli_case(["memory", "--precisions", "int3"], r"Unknown precision 'int3'; known precisions are \['fp32'"),
    cli_case(
        ["memory", "--contexts", "abc"],
        r"--contexts: comma-separated token counts, expected a positive "
        r"integer, got 'abc'",
    ),
    cli_case(["memory", "--budgets", "x"], r"--budgets: comma-separated token counts"),
    cli_case(["memory", "--memory-gb", "0"], r"argument --memory-gb: expected a positive number, got '0'"),
    cli_case(["memory", "--weight-bits", "0"], r"argument --weight-bits: expected a positive integer, got 0"),
    cli_case(["ruler", "--tasks", "niah_single_9"], r"--tasks: \['niah_single_9'\] are not tasks; the tasks are "),
    cli_case(["ruler", "--shard", "3/2"], r"--shard: expected I/N with 0 <= I < N \(e\.g\. 0/4\), got '3/2'"),
    cli_case(["ruler", "--batch-size", "0"], r"argument --batch-size: expected a positive integer, got 0"),
    cli_case(["ruler", "--only", "NoSuchMethod"], r"--only / --exclude: no method left of \['KVzip \(model-wide\)'"),
    cli_case(["ruler", "--summarize-only", "--out", "{tmp}/empty"], r"--out '.*empty': no answers to summarize"),
    cli_case(
        ["serve", "--kv-memory", "12XB"],
        r"argument --kv-memory: expected a size such as 512MiB, 2GiB, 1\.5GB "
        r"or a number of bytes \(units: .*\), got '12XB'",
    ),
    cli_case(["serve", "--kv-memory", "0"], r"argument --kv-memory: expected a size such as 512MiB.*got '0'"),
    cli_case(
        ["serve", "--kv-cache-dtype", "fp6"],
        r"argument --kv-cache-dtype: invalid choice: 'fp6' \(choose from "
        r"'auto', 'model', 'fp8_e4m3', 'fp8_e5m2', 'int8', 'int4'\)",
    ),
    cli_case(
        ["serve", "--kv-cache-quantization", "group_size=8"],
        r"argument --kv-cache-quantization: expected a "
        r"JSON object, got 'group_size=8'",
    ),
    cli_case(
        ["serve", "--kv-cache-quantization", '{"group_size": 0}'],
        r"`kv_cache_quantization\.group_size` must "
        r"be a positive integer or None, got 0",
    ),
    cli_case(
        ["serve", "--kv-cache-quantization", '{"attention": "fast"}'],
        r"`kv_cache_quantization\.attention` must be one of \('auto', 'codes', 'dequantize'\), got 'fast'",
    ),
    cli_case(
        ["serve", "--kv-cache-dtype", "auto", "--kv-cache-quantization", '{"group_size": 32}'],
        r"`kv_cache_quantization` .* was given but `kv_cache_dtype` is 'model'",
    ),
    cli_case(
        ["serve", "--kv-compress", "magic:0.5"],
        r"`--kv-compress\.method` must be one of \('knorm', 'keydiff', 'snapkv', 'kvzap', 'sink_window'\), got 'magic'",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:1"],
        r"`--kv-compress\.ratio` \(the share of the prompt evicted\) must be a number in \[0, 1\), got 1\.0",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:budget=0"],
        r"`--kv-compress\.budget` \(what the prompt keeps\) must be a number of tokens \(an integer >= 1\) or a share "
        r"of the prompt in \(0, 1\], got 0",
    ),
    cli_case(
        ["serve", "--kv-compress", '{"budget": 0.5, "ratio": 0.5}'],
        r"`--kv-compress\.budget` and `--kv-compress\.ratio` are both given",
    ),
    cli_case(
        ["serve", "--kv-compress", '{"budget": 0.5, "speed": 2}'],
        r"`--kv-compress` has unknown keys \['speed'\]; allowed keys are \('method', 'budget', 'sinks', 'recent'",
    ),
    cli_case(
        ["serve", "--kv-compress", "snapkv:0.75:chunk=256"],
        r"`--kv-compress\.chunk` cannot be used with method 'snapkv'",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:0.75:chunk=0"],
        r"`--kv-compress\.chunk` must be an integer >= 1 or .end., got 0",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:budget=0.25:head_budget=max", "--kv-layout", "head"],
        r"`--kv-compress\.head_budget` must be one of \('uniform', 'adaptive'\), got 'max'",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:budget=0.25:safeguard=2", "--kv-layout", "head"],
        r"`--kv-compress\.safeguard` \(the share of its budget every head keeps\) must be in \[0, 1\], got 2",
    ),
    cli_case(
        ["serve", "--kv-compress", "keydiff:budget=0.25:head_budget=uniform", "--kv-layout", "token"],
        r"`--kv-compress\.head_budget` is set, but the pages are laid out by token \(`--kv-layout` 'token'\)",
    ),
    cli_case(
        ["serve", "--kv-layout", "head"],
        r"--kv-layout lays out what eviction keeps: give --kv-compress too",
    ),
    cli_case(
        ["serve", "--kv-layout", "row", "--kv-compress", "none"],
        r"argument --kv-layout: invalid choice: 'row' \(choose from '?token'?, '?head'?\)",
    ),
    cli_case(
        ["serve-bench", "--kv-compress", "none,keydiff:budget=0.25@row"],
        r"`kv_compress` 'keydiff:budget=0\.25@row': the layout after '@' must be one of \('token', 'head'\)",
    ),
    cli_case(
        ["serve-bench", "--kv-compress", "keydiff:0.5"],
        r"`kv_compress` must start with 'none' \(the reference run\), got \('keydiff:0\.5',\)",
    ),
    cli_case(
        ["serve", "--typical-request-tokens", "0"],
        r"argument --typical-request-tokens: expected a positive "
        r"integer, got 0",
    ),
    cli_case(["sweep", "/no/such/spec.yaml"], r"spec: file '/no/such/spec\.yaml' does not exist"),
    cli_case(
        ["sweep", "eval/specs/smoke.yaml", "--dry-run", "--report-only"],
        r"argument --report-only: not allowed with argument --dry-run",
    ),
    cli_case(["export-hub", "{tmp}/out", "--cache", "lru"], r"--cache 'lru': `cache` must be one of \['composite'"),
    cli_case(["export-hub", "{tmp}/out", "--cache", "sink:window=0"], r"`window` must be an integer >= 1, got 0"),
    cli_case(["export-hub", "{tmp}/out"], r"the following arguments are required: --cache"),
    cli_case(["demo", "--prompt-tokens", "0"], r"argument --prompt-tokens: expected a positive integer, got 0"),
    cli_case(["demo", "--offset", "-1"], r"argument --offset: expected an integer >= 0, got -1"),
    cli_case(["nope"], r"argument COMMAND: invalid choice: 'nope' \(choose from 'demo', 'export-hub', 'caches'"),
    cli_case(["caches", "--extra"], r"unrecognized arguments: --extra"),
    cli_case([], r"the following arguments are required: COMMAND", case_id="cli-no-command"),
    # -- hf-kvcache serve: request bodies answered with HTTP 400 naming the field ------------------------------------
    serve_body_case("chat_completion", {"max_tokens": 0}, r"`max_tokens` must be an integer >= 1, got 0"),
    serve_body_case(
        "chat_completion",
        {"max_completion_tokens": "8"},
        r"`max_completion_tokens` must be an integer "
        r">= 1, got '8'",
    ),
    serve_body_case("chat_completion", {"temperature": 3}, r"`temperature` must be a number in \[0, 2\], got 3"),
    serve_body_case("chat_completion", {"top_p": 0}, r"`top_p` must be a number in \(0, 1\], got 0"),
    serve_body_case("chat_completion", {"seed": "x"}, r"`seed` must be an integer, got 'x'"),
    serve_body_case("chat_completion", {"stream": 1}, r"`stream` must be true or false, got 1"),
    serve_body_case("chat_completion", {"n": 3}, r"`n` must be 1 \(this server returns one choice per request\)"),
    serve_body_case("chat_completion", {"messages": "hi"}, r"`messages` must be a non-empty list of messages"),
    serve_body_case(
        "chat_completion",
        {"messages": [{"content": "hi"}]},
        r"`messages\[0\]` must be an object with "
        r"a string `role`",
    ),
    serve_body_case("completion", {"prompt": ["a", "b"]}, r"`prompt` must be a non-empty string"),
    # -- sweep spec fields (what eval/specs/*.yaml hold), checked before any model is loaded ---------------------------
    spec_case("name", "a b", r"^name: must be a simple name \(letters, digits, \._-\), got 'a b'"),
    spec_case("model", None, r"^model: missing \(a Hub id, a local path or 'smollm2'\)", remove=True),
    spec_case("model", 5, r"^model: must be a Hub id, a local path or an offline model \(smollm2, gemma3\), got 5"),
    spec_case("description", 5, r"^description: must be a string, got 5"),
    spec_case("dtype", "float64", r"^dtype: must be one of \['float32', 'bfloat16', 'float16'\], got 'float64'"),
    spec_case("threads", 0, r"^threads: must be an integer >= 1, got 0"),
    spec_case("threads", True, r"^threads: must be an integer >= 1, got True"),
    spec_case("text", 3, r"^text: must be a string, got 3"),
    spec_case(
        "text",
        "/no/such/text.txt",
        r"^text: '/no/such/text\.txt' is not 'pydoc', 'random', 'hf:DATASET' or "
        r"an existing text file",
    ),
    spec_case("text_offset", -1, r"^text_offset: must be an integer >= 0, got -1"),
    spec_case("seed", -2, r"^seed: must be an integer >= 0, got -2"),
    spec_case("context_lengths", [], r"^context_lengths: must be a non-empty list of token counts, got \[\]"),
    spec_case("context_lengths.0", 1, r"^context_lengths\[0\]: must be an integer >= 2, got 1"),
    spec_case("scored_tokens", 0, r"^scored_tokens: must be an integer >= 1, got 0"),
    spec_case("prefill_chunk", 0, r"^prefill_chunk: must be null or an integer >= 1, got 0"),
    spec_case(
        "metrics",
        ["bleu"],
        r"^metrics\[0\]: unknown metric 'bleu'; valid metrics are \['quality', 'ppl', "
        r"'speed', 'retrieval'\]",
    ),
    spec_case("budgets", 0.5, r"^budgets: must be a list, got 0\.5"),
    spec_case("budgets.0", 1.5, r"^budgets\[0\]: a budget fraction must be in \(0, 1\], got 1\.5"),
    spec_case("budgets.1", "150%", r"^budgets\[1\]: a budget fraction must be in \(0, 1\], got '150%'"),
    spec_case("budgets.2", 0, r"^budgets\[2\]: a budget is a number of tokens \(int >= 1\) or a fraction"),
    spec_case("caches", [], r"^caches: must be a non-empty list of \{name, config, budget_key, budgets, label\}"),
    spec_case("caches.1", 5, r"^caches\[1\]: must be a mapping or a cache name, got 5"),
    spec_case("caches.1.name", "lru", r"^caches\[1\]: unknown cache 'lru'; valid names are hf_kvcache caches"),
    spec_case("caches.1.name", None, r"^caches\[1\]\.name: missing", remove=True),
    spec_case(
        "caches.1.config",
        {"windw": 4},
        r"^caches\[1\]: unknown key\(s\) \['windw'\] for cache 'sink'; valid "
        r"keys are \['budget'",
    ),
    spec_case("caches.1.config", {"sinks": -1}, r"^caches\[1\]: invalid config .*`sinks` must be an integer >= 0"),
    spec_case(
        "caches.1.config",
        {"sinks": 4, "budget": 64},
        r"^caches\[1\]\.config\.budget: is also `budget_key`, "
        r"which sets it from the budgets; remove it from `config`",
    ),
    spec_case(
        "caches.1.budget_key",
        "windw",
        r"^caches\[1\]\.budget_key: 'windw' is not a config key of cache 'sink'; "
        r"valid keys are \['budget'",
    ),
    spec_case("caches.1.budget_key", 3, r"^caches\[1\]\.budget_key: must be a config key name, got 3"),
    spec_case(
        "caches.1.extra",
        1,
        r"^caches\[1\]: unknown key\(s\) \['extra'\]; valid keys are \['budget_key', "
        r"'budgets', 'config', 'label', 'name'\]",
    ),
    spec_case("caches.2.budgets", [], r"^caches\[2\]\.budgets: must be a non-empty list, got \[\]"),
    spec_case("caches.0", {"name": "dynamic", "budgets": [0.5]}, r"^caches\[0\]\.budgets: needs `budget_key`"),
    spec_case("caches.2", "dynamic", r"^caches: duplicate cache labels \['dynamic'\]; give each a distinct `label`"),
    spec_case("speed.rounds", 0, r"^speed\.rounds: must be an integer >= 1, got 0"),
    spec_case("speed.extra", 1, r"^speed: unknown key\(s\) \['extra'\]; valid keys are \['decode_tokens', 'rounds'\]"),
    spec_case(
        "retrieval.kinds",
        ["needle"],
        r"^retrieval\.kinds\[0\]: unknown probe 'needle'; valid probes are "
        r"\['passkey', 'records'\]",
    ),
    spec_case(
        "retrieval.positions",
        ["top"],
        r"^retrieval\.positions\[0\]: must be one of \['early', 'middle', "
        r"'late'\] or a depth in \[0, 1\], got 'top'",
    ),
    spec_case("retrieval.positions", [2.0], r"^retrieval\.positions\[0\]: .* or a depth in \[0, 1\], got 2\.0"),
    spec_case("retrieval.samples", 0, r"^retrieval\.samples: must be an integer >= 1, got 0"),
    spec_case("retrieval.context_lengths", [0], r"^retrieval\.context_lengths\[0\]: must be an integer >= 64, got 0"),
    spec_case("retrieval.chat", "yes", r"^retrieval\.chat: must be true or false, got 'yes'"),
    spec_case("ppl", {"mode": "fast"}, r"^ppl\.mode: must be 'stream' or 'chunked', got 'fast'"),
    spec_case("ppl", {"tokens": 0}, r"^ppl\.tokens: must be a positive integer, got 0"),
    spec_case("ppl", 5, r"^ppl: must be a mapping, got int"),
    spec_case("scored", 1, r"^scored: unknown field; valid fields are \['budgets', 'caches'"),
    spec_file_case("name: smoke\nmodel: [smollm2\n", r"spec: .*spec\.yaml is not valid YAML", "truncated YAML"),
    spec_file_case("- name: smoke\n- model: smollm2\n", r"spec: the top level must be a mapping", "a list"),
    spec_file_case(
        '{"name": "smoke", "model": "smollm2", "caches": ["lru"]}',
        r"caches\[0\]: unknown cache 'lru'",
        "JSON (valid YAML) naming an unknown cache",
    ),
    # -- cache state files ---------------------------------------------------------------------------------------------
    state_case(
        "not-safetensors",
        "load_cache_state(path, model): a JSON file",
        _write_bytes(b'{"cache": "sink"}'),
        r"is not a readable safetensors file",
    ),
    state_case(
        "truncated",
        "load_cache_state(path, model): the file cut in half",
        _write_bytes(lambda data: data[: len(data) // 2]),
        r"is not a readable safetensors file|its tensors cannot be read",
    ),
    state_case(
        "empty",
        "load_cache_state(path, model): an empty file",
        _write_bytes(b""),
        r"is not a readable safetensors file",
    ),
    state_case(
        "plain-safetensors",
        "load_cache_state(path, model): a safetensors file from save_file",
        _plain_safetensors,
        r"safetensors file without the 'hf_kvcache' header: not written by "
        r"hf_kvcache\.save_cache_state",
    ),
    state_case(
        "header-not-json",
        "load_cache_state(path, model): header 'hf_kvcache' = '{cache: sink'",
        _rewrite_state_header(lambda h: "{cache: sink"),
        r"its 'hf_kvcache' header is not valid JSON",
    ),
    state_case(
        "header-list",
        "load_cache_state(path, model): header 'hf_kvcache' = '[1]'",
        _rewrite_state_header(lambda h: "[1]"),
        r"header must be a JSON object, got list",
    ),
    state_case(
        "format-version",
        "load_cache_state(path, model): format_version 99",
        _rewrite_state_header(lambda h: h.update(format_version=99)),
        r"field `format_version` is 99 .*reads version 1",
    ),
    state_case(
        "format",
        "load_cache_state(path, model): format 'other'",
        _rewrite_state_header(lambda h: h.update(format="other")),
        r"field `format` is 'other', expected 'hf_kvcache\.cache_state'",
    ),
    state_case(
        "missing-state",
        "load_cache_state(path, model): header without the state field",
        _rewrite_state_header(lambda h: h.pop("state")),
        r"field `state` is missing from its header",
    ),
    state_case(
        "unknown-cache",
        "load_cache_state(path, model): cache 'lru' in the header",
        _rewrite_state_header(lambda h: h.update(cache="lru")),
        r"field `cache` is 'lru', not one of "
        r"\['composite'",
    ),
    state_case(
        "other-cache",
        "load_cache_state(path, model, cache='h2o') of a sink state",
        lambda path: path,
        r"field `cache` is 'sink', but 'h2o' was asked for",
        load_kwargs=lambda: {"cache": "h2o"},
    ),
    state_case(
        "bad-cache-arg",
        "load_cache_state(path, model, cache='lru')",
        lambda path: path,
        r"`cache` must be one of \['composite'.*got 'lru'",
        load_kwargs=lambda: {"cache": "lru"},
    ),
    state_case(
        "other-model",
        "load_cache_state(path, model with 3 layers) of a 2-layer model's state",
        lambda path: path,
        r"field `model\.num_hidden_layers` is 2 in the file, but 3 for the given model",
        load_kwargs=lambda: {"config_or_model": build_config("llama", num_hidden_layers=3)},
    ),
    state_case(
        "other-heads",
        "load_cache_state(path, config with 4 KV heads) of a 2-KV-head model's state",
        lambda path: path,
        r"field `model\.num_key_value_heads` is 2 in the file, but 4",
        load_kwargs=lambda: {"config_or_model": build_config("llama", num_key_value_heads=4)},
    ),
    state_case(
        "not-a-model",
        "load_cache_state(path, 'llama')",
        lambda path: path,
        r"`config_or_model` must be a transformers model or its config, got str",
        load_kwargs=lambda: {"config_or_model": "llama"},
    ),
    state_case(
        "other-layout",
        "load_cache_state(path, model): layer 0's store recorded as a QuantizedStore",
        _rewrite_state_header(
            lambda h: h["state"]["layers"]["list"][0]["fields"]["store"].update(
                object="hf_kvcache.stores.quantized.QuantizedStore"
            )
        ),
        r"field `state\.layers\.0\.store`: the file holds a hf_kvcache\.stores\.quantized\.QuantizedStore here",
    ),
    state_case(
        "missing-tensor",
        "load_cache_state(path, model): a tensor the header names is missing",
        _rewrite_state_header(
            lambda h: h["state"]["layers"]["list"][0]["fields"].update(slot_valid={"tensor": "nowhere"})
        ),
        r"field `state\.layers\.0\.slot_valid`: names tensor 'nowhere', "
        r"which the file does not hold",
    ),
    state_case(
        "missing-file",
        "load_cache_state('missing.safetensors', model)",
        lambda path: path.with_name("missing.safetensors"),
        r"does not exist",
        error=FileNotFoundError,
    ),
    Case(
        "state-save-dynamic",
        "cache state files",
        "save_cache_state(DynamicCache(), path)",
        lambda: hf_kvcache.save_cache_state(transformers.DynamicCache(), "unused.safetensors"),
        ValueError,
        r"`cache` must be an hf_kvcache cache \(a KVCache\), got DynamicCache",
    ),
]


def _bad_scorer_values(field) -> list:
    """Values a scorer parameter must refuse, by the type of its default (floats are free)."""
    if isinstance(field.default, bool):
        return ["yes"]
    if isinstance(field.default, int):
        return [-1]
    if isinstance(field.default, str):
        return ["no-such-value"]
    return []


def _scorer_cases() -> list[Case]:
    """From the scorer registry: each scorer parameter given a bad value, to the scorer's cache and to a composite's
    heavy region ranked by it (a new scorer's parameters get their rows here without a line of this file)."""
    cases = []
    for name, scorer in SCORERS.items():
        cache = hf_kvcache.CACHE_IMPLEMENTATIONS[name]
        CLASSES.setdefault(cache.__name__, cache)
        size = {"heavy": 4, "recent": 4} if name in ("h2o", "random_eviction") else {"budget": 8}
        for parameter in dataclasses.fields(scorer):
            if parameter.name not in options_of(name):
                continue
            for value in _bad_scorer_values(parameter):
                cases.append(ctor(cache.__name__, match=rf"`{parameter.name}`", **size, **{parameter.name: value}))
                if name in HEAVY_SCORERS:
                    heavy = {"role": "heavy", "tokens": 4, "scorer": name, parameter.name: value}
                    regions = [{"role": "window", "start": 0, "end": 8}, heavy]
                    cases.append(region_case(regions, rf"`regions\[1\]\.{parameter.name}`"))
    return cases


CASES += _scorer_cases()


# -- the tests --------------------------------------------------------------------------------------------------------
RESULTS: dict[str, tuple[str, str]] = {}  # case id -> (error type, message) raised in this session


def test_case_ids_are_unique_and_enough():
    ids = [case.id for case in CASES]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, duplicates
    assert len(CASES) >= 100, len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case):
    with pytest.raises(case.error) as info:
        case.run()
    message = str(info.value)
    assert re.search(case.match, message, re.S), f"message does not match {case.match!r}:\n{message}"
    assert "Traceback" not in message
    if case.after is not None:
        case.after()
    RESULTS[case.id] = (info.type.__name__, message)


def test_memory_check_allows_what_fits():
    """The budget check refuses only what cannot fit: a large but possible budget allocates as usual."""
    m = build_model("llama")
    cache = hf_kvcache.SlidingWindowCache(m, window=100_000)  # ~25 MB of keys and values
    forward(m, cache, random_ids(1, 6))
    assert cache.get_seq_length() == 6 and cache.nbytes() >= 2 * 2 * 2 * 100_000 * 16 * 4


# -- docs/bad_inputs.md -----------------------------------------------------------------------------------------------
def _normalise(message: str) -> str:
    message = re.sub(
        r"/[^\s'\"]*?/(kvcache_config\.json|generation_config\.json|state\.safetensors|"
        r"missing\.safetensors|spec\.yaml)",
        r"<dir>/\1",
        message,
    )
    message = re.sub(r"total memory \([\d,]+ bytes\)", "total memory (N bytes)", message)
    message = " ".join(message.split())
    return message if len(message) <= EXCERPT else message[: EXCERPT - 1] + "…"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _prose_cell(text: str) -> str:
    """A message as table text: brackets escaped, so `x[1][0]` is not read as a Markdown reference link."""
    return _cell(text).replace("[", "\\[").replace("]", "\\]")


def render(results: dict[str, tuple[str, str]]) -> str:
    lines = [
        "# Bad inputs and the errors they raise",
        "",
        "Generated by `tests/test_bad_input_matrix.py` from its case table and the messages raised (do not edit:",
        "`HF_KVCACHE_WRITE_BAD_INPUTS=1 pytest tests/test_bad_input_matrix.py` rewrites it). Every case checks the",
        "exception type and that the message names the field (and the allowed values where it lists them). Cases on",
        "a live cache also check that the failed call left the cache unchanged and that the next valid call gives",
        "the same logits as a cache that never saw it. Budgets larger than the device's total memory are refused",
        "before allocating, with the bytes they would need (machine-specific numbers shown as N).",
        "",
        f"{len(CASES)} cases.",
        "",
        "| # | group | input | error | message (excerpt) |",
        "|---|---|---|---|---|",
    ]
    for i, case in enumerate(CASES, 1):
        error, message = results[case.id]
        lines.append(f"| {i} | {case.group} | `{_cell(case.input)}` | {error} | {_prose_cell(_normalise(message))} |")
    return "\n".join(lines) + "\n"


def test_docs_table_is_current():
    """Last: renders docs/bad_inputs.md from this session's results; compares (or writes, with the env var)."""
    missing = [case.id for case in CASES if case.id not in RESULTS]
    if missing:
        pytest.skip(f"only {len(CASES) - len(missing)} of {len(CASES)} cases ran in this session")
    text = render(RESULTS)
    if WRITE:
        DOC.write_text(text)
        return
    skip_unless_locked_versions("docs/bad_inputs.md")
    assert DOC.exists() and DOC.read_text() == text, (
        "docs/bad_inputs.md is stale: run `HF_KVCACHE_WRITE_BAD_INPUTS=1 pytest tests/test_bad_input_matrix.py` "
        "and commit it"
    )
