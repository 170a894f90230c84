"""Cache state files (hf_kvcache.sharing.state): pause a stream, save, load into a fresh cache, resume -- the logits of
every step after the pause equal those of the uninterrupted run exactly, for every cache family; files from another
version, cache or model shape, and files that are not state files, are refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_model, left_pad, random_ids
from safetensors import safe_open
from safetensors.torch import save_file

import hf_kvcache
from hf_kvcache import cache_kwargs, load_cache_state, save_cache_state

KVZIP_REQUEST = {"first": [5, 6, 7], "next": [8, 9], "suffix": [10]}
CACHES = {
    "sink": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6),
    "sink_original": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6, position_mode="original"),
    "sliding": lambda m: hf_kvcache.SlidingWindowCache(m, window=8),
    "h2o": lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4),
    "h2o_compact": lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4, position_mode="compact"),
    "h2o_ratio": lambda m: hf_kvcache.H2OCache(m, heavy=0.3, recent=0.3),
    "random_eviction": lambda m: hf_kvcache.RandomEvictionCache(m, heavy=4, recent=4, seed=3),
    "composite": lambda m: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=12),
    "composite_tiers": lambda m: hf_kvcache.CompositeCache(
        m,
        regions=[
            {"role": "sinks", "tokens": 2},
            {"role": "window", "start": 0, "end": 3},
            {"role": "window", "start": 3, "end": 6, "keys": "fp8_e4m3", "values": "int8"},
            {"role": "rest", "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        ],
    ),
    "fp8": lambda m: hf_kvcache.QuantizedFP8Cache(m),
    "fp8_residual_head": lambda m: hf_kvcache.QuantizedFP8Cache(m, residual=4, granularity="head"),
    "fp8_tensor": lambda m: hf_kvcache.QuantizedFP8Cache(m, granularity="tensor", key_smoothing=True),
    "fp8_max_length": lambda m: hf_kvcache.QuantizedFP8Cache(m, max_length=64),
    "kivi": lambda m: hf_kvcache.KIVICache(m, residual=8, group_size=8),
    "per_layer": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6, layers={1: {"cache": "h2o", "budget": 8}}),
    # the scorer caches (issue 14): nothing of theirs needed a state method (see hf_kvcache.sharing.state)
    "knorm": lambda m: hf_kvcache.CACHE_IMPLEMENTATIONS["knorm"](m, budget=8),
    "keydiff_prompt": lambda m: hf_kvcache.CACHE_IMPLEMENTATIONS["keydiff"](m, budget=8, compress="prompt"),
    "tova": lambda m: hf_kvcache.CACHE_IMPLEMENTATIONS["tova"](m, budget=8),
    "snapkv": lambda m: hf_kvcache.CACHE_IMPLEMENTATIONS["snapkv"](m, budget=8, window=4),
    "expected_attention": lambda m: hf_kvcache.CACHE_IMPLEMENTATIONS["expected_attention"](m, budget=8),
    "kvzip": lambda m: hf_kvcache.KVzipCache(m, budget=5, request_ids=KVZIP_REQUEST),
    "kvzip_model_wide": lambda m: hf_kvcache.KVzipCache(
        m, budget=5, head_budget="adaptive", layer_budget="adaptive", request_ids=KVZIP_REQUEST
    ),
    "composite_prompt": lambda m: hf_kvcache.CompositeCache(
        m, preset="sinks_heavy_recent", budget=12, compress="prompt"
    ),
    "composite_snapkv": lambda m: hf_kvcache.CompositeCache(
        m,
        regions=[
            {"role": "sinks", "tokens": 2},
            {"role": "window", "start": 0, "end": 3},
            {"role": "heavy", "tokens": 4, "scorer": "snapkv", "window": 3},
        ],
    ),
    "composite_expected_attention_prompt": lambda m: hf_kvcache.CompositeCache(
        m,
        compress="prompt",
        regions=[
            {"role": "sinks", "tokens": 2},
            {"role": "window", "start": 0, "end": 3},
            {"role": "heavy", "tokens": 4, "scorer": "expected_attention", "keys": "fp8_e4m3", "values": "int8"},
        ],
    ),
}
STEPS_BEFORE, STEPS_AFTER = 9, 8


def _forward(model, cache, ids, mask):
    """One forward of `ids` [B, q] after the tokens of `mask` already in the cache; returns (logits, new mask)."""
    mask = torch.cat((mask, torch.ones_like(ids)), 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
    return out.logits, mask


def _prefix(model, cache):
    """A left-padded prompt of 2 rows in two chunks, then STEPS_BEFORE decode steps (past every budget)."""
    ids, mask = left_pad([random_ids(1, 10, seed=1)[0], random_ids(1, 7, seed=2)[0]])
    with torch.no_grad():
        model(
            input_ids=ids[:, :6],
            attention_mask=mask[:, :6],
            position_ids=(mask[:, :6].cumsum(-1) - 1).clamp(min=0),
            **cache_kwargs(cache),
            use_cache=True,
        )
    logits, mask = _forward(model, cache, ids[:, 6:], mask[:, :6])
    for _step in range(STEPS_BEFORE):
        logits, mask = _forward(model, cache, logits[:, -1:].argmax(-1), mask)
    return logits[:, -1:].argmax(-1), mask


def _continue(model, cache, token, mask):
    """STEPS_AFTER greedy decode steps and one 3-token chunk: every step's logits."""
    out = []
    for _ in range(STEPS_AFTER):
        logits, mask = _forward(model, cache, token, mask)
        out.append(logits)
        token = logits[:, -1:].argmax(-1)
    logits, mask = _forward(model, cache, random_ids(2, 3, seed=9), mask)
    return torch.cat(out + [logits], 1)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_pause_save_load_resume_equals_uninterrupted(name, tmp_path):
    model = build_model("llama")
    cache = CACHES[name](model)
    token, mask = _prefix(model, cache)
    path = tmp_path / "state.safetensors"
    save_cache_state(cache, path)
    before = cache.nbytes()

    resumed = load_cache_state(path, build_model("llama"), cache=type(cache))  # a fresh model object, same weights
    assert type(resumed) is type(cache)
    assert resumed.get_seq_length() == cache.get_seq_length()
    assert resumed.nbytes() == before
    expected = _continue(model, cache, token, mask)
    model2 = build_model("llama")
    hf_kvcache.enable(model2)
    got = _continue(model2, resumed, token, mask)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_a_cache_without_the_state_continues_differently():
    """Non-vacuity: the same settings without the saved state (an empty cache) give other logits."""
    model = build_model("llama")
    cache = CACHES["h2o"](model)
    token, mask = _prefix(model, cache)
    expected = _continue(model, cache, token, mask)
    blank = CACHES["h2o"](model)
    assert not torch.allclose(_continue(model, blank, token, mask[:, :0]), expected)


def test_resume_in_a_fresh_process(tmp_path):
    """Saved here, loaded in another Python process (nothing shared but the file): the same next logits."""
    model = build_model("llama")
    cache = CACHES["composite"](model)
    token, mask = _prefix(model, cache)
    save_cache_state(cache, tmp_path / "c.safetensors")
    torch.save({"token": token, "mask": mask}, tmp_path / "inputs.pt")
    expected = _continue(model, cache, token, mask)
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import build_model
from test_state import _continue
import hf_kvcache
model = build_model("llama")
cache = hf_kvcache.load_cache_state({str(tmp_path / "c.safetensors")!r}, model)
inputs = torch.load({str(tmp_path / "inputs.pt")!r})
torch.save(_continue(model, cache, inputs["token"], inputs["mask"]), {str(tmp_path / "out.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


# -- files that must be refused, naming the field ---------------------------------------------------------------------
def _saved(tmp_path, make=CACHES["sink"], arch="llama", **overrides):
    model = build_model(arch, **overrides)
    cache = make(model)
    _prefix(model, cache)
    path = tmp_path / "state.safetensors"
    save_cache_state(cache, path)
    return path


def _rewrite_header(path, edit):
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not iterable)
        header = json.loads(f.metadata()["hf_kvcache"])
    edit(header)
    save_file(tensors, str(path), metadata={"hf_kvcache": json.dumps(header)})


def test_other_cache_model_shape_and_version_are_refused(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"field `cache` is 'sink', but 'h2o' was asked for"):
        load_cache_state(path, build_model("llama"), cache="h2o")
    with pytest.raises(ValueError, match=r"field `model.num_hidden_layers` is 2 in the file, but 3"):
        load_cache_state(path, build_model("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"field `model.num_key_value_heads` is 2 in the file, but 4"):
        load_cache_state(path, build_model("llama", num_key_value_heads=4))
    with pytest.raises(ValueError, match=r"field `model.model_type` is 'llama' in the file, but 'qwen2'"):
        load_cache_state(path, build_model("qwen2"))
    with pytest.raises(ValueError, match=r"`cache` must be one of \['composite'.*got 'lru'"):
        load_cache_state(path, build_model("llama"), cache="lru")
    _rewrite_header(path, lambda h: h.update(format_version=99))
    with pytest.raises(ValueError, match=r"field `format_version` is 99 .*reads version 1"):
        load_cache_state(path, build_model("llama"))


def test_state_tree_of_another_layout_is_refused(tmp_path):
    path = _saved(tmp_path)

    def swap_store(header):
        store = header["state"]["layers"]["list"][0]["fields"]["store"]
        store["object"] = "hf_kvcache.stores.quantized.QuantizedStore"

    _rewrite_header(path, swap_store)
    with pytest.raises(
        ValueError,
        match=r"field `state.layers.0.store`: the file holds a .*QuantizedStore here, this "
        r"cache a hf_kvcache.stores.full.FullPrecisionStore",
    ):
        load_cache_state(path, build_model("llama"))


def test_kvzip_state_naming_the_scorer_reconstruction_loads(tmp_path):
    """Up to 0.3.0 the KVzip scorer class was `Reconstruction` (now `KVzip`): files that name it still load."""
    model = build_model("llama")
    cache = CACHES["kvzip"](model)
    token, mask = _prefix(model, cache)
    path = tmp_path / "state.safetensors"
    save_cache_state(cache, path)
    renamed = []

    def old_name(node):
        if isinstance(node, dict):
            if node.get("object") == "hf_kvcache.scorers.kvzip.KVzip":
                node["object"] = "hf_kvcache.scorers.kvzip.Reconstruction"
                renamed.append(node)
            for value in node.values():
                old_name(value)
        elif isinstance(node, list):
            for value in node:
                old_name(value)

    _rewrite_header(path, old_name)
    assert renamed  # the placed layers hold the scorer
    resumed = load_cache_state(path, build_model("llama"))
    expected = _continue(model, cache, token, mask)
    model2 = build_model("llama")
    hf_kvcache.enable(model2)
    assert torch.equal(_continue(model2, resumed, token, mask), expected)


def test_files_that_are_not_state_files(tmp_path):
    model = build_model("llama")
    not_safetensors = tmp_path / "a.json"
    not_safetensors.write_text('{"cache": "sink"}')
    with pytest.raises(ValueError, match=r"not a readable safetensors file"):
        load_cache_state(not_safetensors, model)
    path = _saved(tmp_path)
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"not a readable safetensors file|tensors cannot be read"):
        load_cache_state(truncated, model)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match=r"without the 'hf_kvcache' header"):
        load_cache_state(plain, model)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_cache_state(tmp_path / "missing.safetensors", model)
    with pytest.raises(ValueError, match=r"`cache` must be an hf_kvcache cache"):
        save_cache_state(transformers_dynamic_cache(), tmp_path / "d.safetensors")


def transformers_dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache()


def test_no_pickle_and_json_header(tmp_path):
    """The file is plain safetensors; the settings are readable JSON (what a user would inspect)."""
    path = _saved(tmp_path, CACHES["kivi"])
    header = hf_kvcache.read_cache_state_header(path)
    assert header["cache"] == "kivi" and dict(header["settings"]["dict"]) == {"residual": 8, "group_size": 8}
    assert header["model"]["layer_types"] == ["full_attention", "full_attention"]
    assert b"pickle" not in path.read_bytes()[:64] and path.read_bytes()[8:9] == b"{"


@pytest.mark.parametrize(
    "make,window_class",
    [
        (lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4), "StaticSlidingWindowLayer"),  # fixed capacity
        (lambda m: hf_kvcache.QuantizedFP8Cache(m), "DynamicSlidingWindowLayer"),  # grows with the stream
    ],
)
def test_hybrid_model_keeps_transformers_sliding_layers_state(tmp_path, make, window_class):
    """A model with a sliding-window layer: that layer is transformers' own (StaticCache's under a fixed-capacity
    cache, DynamicCache's otherwise), saved and restored like ours."""

    def make_model():
        return build_model(
            "qwen2", use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
        )

    model = make_model()
    cache = make(model)
    assert type(cache.layers[0]).__name__ == window_class
    token, mask = _prefix(model, cache)
    save_cache_state(cache, tmp_path / "s.safetensors")
    resumed = load_cache_state(tmp_path / "s.safetensors", make_model())
    assert type(resumed.layers[0]).__name__ == window_class
    assert torch.equal(resumed.layers[0].keys, cache.layers[0].keys)
    expected = _continue(model, cache, token, mask)
    model2 = make_model()
    hf_kvcache.enable(model2)
    assert torch.equal(_continue(model2, resumed, token, mask), expected)
