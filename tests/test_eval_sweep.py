"""Sweeps: resumable after an interruption, bad specs rejected before any model is loaded; memory calculator."""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import pytest
from conftest import build_model

from hf_kvcache.evaluation import memory
from hf_kvcache.evaluation.sweep import SpecError, load_spec, plan_cells, read_results, run_sweep

SPEC = {
    "name": "tiny",
    "model": "tiny-model",
    "text": "random",
    "text_offset": 0,
    "context_lengths": [40],
    "scored_tokens": 8,
    "metrics": ["quality", "ppl", "speed"],
    "budgets": [0.25, 0.5],
    "caches": [
        {"name": "dynamic"},
        {"name": "sink", "config": {"sinks": 2}, "budget_key": "budget"},
        {"name": "sliding", "budget_key": "window", "budgets": [16]},
    ],
    "ppl": {"tokens": 60, "mode": "chunked", "chunk": 8, "bucket": 20},
    "speed": {"decode_tokens": 2, "rounds": 1},
}


class Interrupt(Exception):
    pass


def counting_loader(counter):
    def load(name, dtype):
        counter["loads"] += 1
        return build_model("llama", seed=1), None

    return load


def test_interrupted_sweep_resumes_without_recomputing(tmp_path):
    cells = plan_cells(load_spec(SPEC))
    assert len(cells) == 4 * 2 + 1  # (dynamic, sink x2, sliding) x (quality, ppl) + one interleaved speed cell
    counter, seen = {"loads": 0}, []

    def stop_after_three(cell):
        seen.append(cell.key("x"))
        if len(seen) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_sweep(SPEC, tmp_path, loader=counting_loader(counter), progress=False, on_cell=stop_after_three)
    first = read_results(tmp_path / "tiny" / "results.jsonl")
    assert len(first) == 3
    # a line cut short by a kill mid-write is ignored, not fatal
    with open(tmp_path / "tiny" / "results.jsonl", "a") as f:
        f.write('{"key": "half a li')
    again = []
    rows = run_sweep(
        SPEC, tmp_path, loader=counting_loader(counter), progress=False, on_cell=lambda c: again.append(c.key("x"))
    )
    assert len(again) == len(cells) - 3 and not set(again) & set(seen)
    done = read_results(tmp_path / "tiny" / "results.jsonl")
    assert len(done) == len(cells)
    for key, rec in first.items():  # finished cells were kept as they were
        assert done[key]["rows"] == rec["rows"]
    # a third run has nothing to do and does not even load the model
    loads = counter["loads"]
    run_sweep(SPEC, tmp_path, loader=counting_loader(counter), progress=False)
    assert counter["loads"] == loads
    metrics = {r["metric"] for r in rows}
    assert metrics == {"quality", "ppl", "speed"}
    quality = {r["label"]: r for r in rows if r["metric"] == "quality"}
    assert quality["dynamic"]["kl_mean"] < 1e-6 and quality["sink 25%"]["kl_mean"] > 1e-3
    assert quality["sink 25%"]["budget_tokens"] == 10 and quality["sliding 16"]["budget_tokens"] == 16
    assert quality["sink 25%"]["bytes_held"] < quality["sink 50%"]["bytes_held"] < quality["dynamic"]["bytes_held"]
    speed = [r for r in rows if r["metric"] == "speed"]
    assert {r["label"] for r in speed} == set(quality) and [
        r["decode_ratio"] for r in speed if r["label"] == "dynamic"
    ] == [1.0]
    out = tmp_path / "tiny"
    assert (out / "results.csv").read_text().splitlines()[0].startswith("metric,context_len,label")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["torch"] and len(summary["rows"]) == len(rows)
    assert (out / "quality_vs_bytes.png").stat().st_size > 1000 and (out / "ppl_buckets.png").is_file()


def test_stream_ppl_cell_resumes_inside_the_cell(tmp_path):
    """An exact-protocol ppl cell interrupted mid-stream resumes from its checkpoint with identical results."""
    import numpy as np

    from hf_kvcache.evaluation import streaming

    spec = {
        **SPEC,
        "metrics": ["ppl"],
        "caches": [{"name": "sink", "config": {"sinks": 2, "budget": 12}}],
        "ppl": {"tokens": 50, "mode": "stream", "bucket": 10},
    }
    clean = run_sweep({**spec, "name": "clean"}, tmp_path, loader=counting_loader({"loads": 0}), progress=False)
    real = streaming.stream_nll
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            real(*args, **{**kwargs, "checkpoint_every": 8, "stop_after": 30})
            raise Interrupt
        return real(*args, **kwargs)

    import hf_kvcache.evaluation.perplexity as perplexity

    original = perplexity.stream_nll
    perplexity.stream_nll = interrupted
    try:
        with pytest.raises(Interrupt):
            run_sweep(spec, tmp_path, loader=counting_loader({"loads": 0}), progress=False)
        ckpts = list((tmp_path / "tiny" / "checkpoints").glob("*.pt"))
        assert len(ckpts) == 1 and streaming.read_progress(ckpts[0])[1]["done"] == 30
        rows = run_sweep(spec, tmp_path, loader=counting_loader({"loads": 0}), progress=False)
    finally:
        perplexity.stream_nll = original
    assert not list((tmp_path / "tiny" / "checkpoints").glob("*"))  # removed once the cell finished
    assert rows[0]["ppl"] == clean[0]["ppl"] and rows[0]["buckets"] == clean[0]["buckets"]
    assert np.isfinite(rows[0]["ppl"]) and "stream" in rows[0]["protocol"]


def test_changed_settings_recompute(tmp_path):
    spec = {**SPEC, "metrics": ["quality"], "caches": [{"name": "dynamic"}]}
    run_sweep(spec, tmp_path, loader=counting_loader({"loads": 0}), progress=False)
    ran = []
    run_sweep(
        {**spec, "scored_tokens": 6},
        tmp_path,
        loader=counting_loader({"loads": 0}),
        progress=False,
        on_cell=lambda c: ran.append(c),
    )
    assert len(ran) == 1


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"caches": [{"name": "sinkk", "budget_key": "budget"}]}, r"^caches\[0\]: unknown cache 'sinkk'; valid names"),
        (
            {"caches": [{"name": "dynamic"}, {"name": "sink", "config": {"sinks": 2, "windw": 3}}]},
            r"^caches\[1\]: unknown key\(s\) \['windw'\]",
        ),
        ({"budgets": [0.25, 1.5]}, r"^budgets\[1\]: a budget fraction must be in \(0, 1\]"),
        ({"budgets": [0.25, "all"]}, r"^budgets\[1\]: a budget is a number of tokens"),
        ({"budgets": [2]}, r"^caches\[1\]: invalid config .* `sinks` \(2\) must be smaller than `budget` \(2\)"),
        ({"metrics": ["quality", "bleu"]}, r"^metrics\[1\]: unknown metric 'bleu'"),
        ({"context_lengths": [40, 0]}, r"^context_lengths\[1\]: must be an integer >= 2"),
        ({"model": "./no/such/dir"}, r"^model: local model directory './no/such/dir' does not exist"),
        ({"text": "/no/such/file.txt"}, r"^text: '/no/such/file.txt' is not"),
        ({"ppl": {"tokens": 60, "mode": "fast"}}, r"^ppl\.mode: must be 'stream' or 'chunked'"),
        ({"speed": {"rounds": 0}}, r"^speed\.rounds: must be an integer >= 1"),
        (
            {"retrieval": {"kinds": ["needle"]}, "metrics": ["retrieval"], "text": "pydoc"},
            r"^retrieval\.kinds\[0\]: unknown probe 'needle'",
        ),
        ({"cachez": []}, r"^cachez: unknown field"),
        ({"caches": [{"name": "sliding", "budget_key": "window", "budgets": []}]}, r"^caches\[0\]\.budgets: must be"),
    ],
)
def test_bad_spec_fails_before_loading_the_model(tmp_path, patch, field):
    spec = {**SPEC, **patch}

    def loader(name, dtype):
        raise AssertionError("the model must not be loaded for a bad spec")

    with pytest.raises(SpecError, match=field):
        run_sweep(spec, tmp_path, loader=loader, progress=False)
    assert not (tmp_path / "tiny").exists()


def test_bad_yaml_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("caches: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


SPECS = sorted((Path(__file__).resolve().parents[1] / "eval" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_specs_are_valid(path):
    import yaml

    from hf_kvcache.evaluation.cache_spec import available_caches

    known = set(available_caches()["hf_kvcache"]) | set(available_caches()["transformers"])
    missing = {c["name"] for c in yaml.safe_load(path.read_text())["caches"]} - known
    if missing:
        pytest.skip(f"{path.name} uses caches not registered yet: {sorted(missing)}")
    assert plan_cells(load_spec(path))


# -- memory calculator -----------------------------------------------------------------------------------------------
def test_memory_calculator_published_figures():
    kib = 1024
    assert memory.bytes_per_token("llama-3-8b", "fp16") == 128 * kib
    assert memory.bytes_per_token("llama-3-8b", "fp8") == 64 * kib
    assert memory.bytes_per_token("llama-3-8b", "int4-g64") == 34 * kib  # 4 bits + one FP16 scale per 64 values
    assert memory.bytes_per_token("llama-3-8b", "int4-g32-asym") == 40 * kib  # FP16 scale + zero per 32: 5 bits
    # Llama-2-70B / Llama-3-70B (GQA, 8 KV heads) at 128K (128,000) tokens in FP16: 41.9 GB
    assert round(memory.kv_cache_bytes("llama-3-70b", "fp16", 128_000) / 1e9, 1) == 41.9
    # Llama-2-7B (MHA): 512 KiB/token, 2 GiB at 4K
    assert memory.kv_cache_bytes("llama-2-7b", "fp16", 4096) == 2 * 2**30
    # Gemma 3 27B: 10 of its 62 layers hold every token (16 KV heads x 128), the other 52 a window of 1024 tokens;
    # counted as 62 full layers it would be 496 KiB a token, 62 GiB at 128K instead of 10.4
    assert memory.bytes_per_token("gemma-3-27b", "fp16") == 80 * kib
    window = 52 * 1024 * 2 * 16 * 128 * 2
    assert memory.kv_cache_bytes("gemma-3-27b", "fp16", 131072) == 80 * kib * 131072 + window
    assert memory.kv_cache_bytes("gemma-3-27b", "fp16", 512) == 62 * 512 * 2 * 16 * 128 * 2  # windows not yet full
    # a token budget applies to the full layers only (the sliding ones hold their window anyway)
    assert memory.kv_cache_bytes("gemma-3-27b", "fp16", 131072, kept=4096) == 80 * kib * 4096 + window


#: the published hybrid shapes, as transformers' own config classes build them from the same published values
PUBLISHED_HYBRIDS = {
    "gemma-2-9b": (
        "Gemma2Config",
        dict(
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            hidden_size=3584,
            sliding_window=4096,
        ),
    ),
    "gemma-3-12b": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            hidden_size=3840,
            sliding_window=1024,
        ),
    ),
    "gemma-3-27b": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            hidden_size=5376,
            sliding_window=1024,
        ),
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        dict(
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            hidden_size=2880,
            sliding_window=128,
        ),
    ),
    "gpt-oss-120b": (
        "GptOssConfig",
        dict(
            num_hidden_layers=36,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            hidden_size=2880,
            sliding_window=128,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_HYBRIDS))
def test_published_hybrid_shapes_follow_transformers_layer_types(name):
    """Each hybrid in SHAPES has the layer pattern transformers gives its config (layer_types), layer for layer."""
    import transformers

    class_name, values = PUBLISHED_HYBRIDS[name]
    from_config = memory.shape_from_config(getattr(transformers, class_name)(**values))
    published = memory.SHAPES[name]
    assert from_config.kv_layers() == published.kv_layers()
    assert (from_config.layers, from_config.kv_heads, from_config.head_dim) == (
        published.layers,
        published.kv_heads,
        published.head_dim,
    )
    assert any(layer.window for layer in published.kv_layers()) and any(
        layer.window is None for layer in published.kv_layers()
    )


def test_published_latent_attention_shape():
    """DeepSeek-V3 (MLA) caches, per layer and token, its 512-value latent and the keys' 64-value RoPE part: 576
    values, where its 128 heads of 192-value keys and 128-value values would be 40960 (71x)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    published = memory.SHAPES["deepseek-v3"]
    assert memory.shape_from_config(config).kv_layers() == published.kv_layers()
    assert memory.bytes_per_token("deepseek-v3", "bf16") == 61 * 576 * 2
    assert memory.kv_cache_bytes(config, "bf16", 131072) == 61 * 576 * 2 * 131072  # 8.6 GiB at 128K


@pytest.mark.parametrize("arch", sorted(model_zoo.ZOO))
def test_theory_is_what_dynamic_cache_holds_on_every_architecture(arch):
    """For every architecture of the model zoo, the calculator's bytes after 40 tokens (`kv_cache_bytes`, layer by
    layer) are what transformers' DynamicCache holds in its layers that keep keys and values, give or take a layer's
    int64 token counter: sliding windows, KV sharing, head sizes per layer, MLA's latent included. (Linear-attention
    and convolution layers keep a fixed state per request, not a KV cache; the calculator leaves them out. The
    tokens end with one-token steps: right after a prompt, a DynamicCache sliding layer's window is a view into the
    prompt's whole keys, which it holds until its next update.)"""
    import torch
    from conftest import random_ids
    from transformers import DynamicCache

    from hf_kvcache import cache_kwargs
    from hf_kvcache.common.architecture import layer_plan

    model = model_zoo.build(arch)
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    ids = random_ids(1, 40, seed=2)
    with torch.inference_mode():
        model(input_ids=ids[:, :36], **cache_kwargs(cache), use_cache=True)
        for t in range(36, 40):
            model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
    seen: set = set()
    layer_types, _ = layer_plan(config)
    held = sum(
        memory._tensor_bytes(layer, seen)
        for layer_type, layer in zip(layer_types, cache.layers)
        if layer_type not in memory.NO_KV_TYPES
    )
    theory = memory.kv_cache_bytes(config, memory.Precision("fp32", 32), 40)
    assert 0 <= held - theory <= 8 * len(cache.layers), (held, theory)


def test_memory_from_config_and_concurrency():
    model = build_model("llama")
    shape = memory.shape_from_config(model.config)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (2, 2, 16)
    assert memory.bytes_per_token(model.config, "fp32") == 2 * 2 * 2 * 16 * 4
    # 80 GB, 16 GB of weights, 8K context at 128 KiB/token = 1 GiB per request
    assert memory.max_concurrent_requests(80e9, "llama-3-8b", "fp16", 8192, reserved_bytes=16e9) == 59
    assert memory.max_concurrent_requests(80e9, "llama-3-8b", "fp16", 8192, 16e9, budget_tokens=1024) == 476
    with pytest.raises(ValueError, match="Unknown precision 'int5'"):
        memory.bytes_per_token("llama-3-8b", "int5")
    with pytest.raises(ValueError, match="Unknown model shape"):
        memory.bytes_per_token("gpt-9", "fp16")
    # on a hybrid model a budget leaves the sliding layers' windows: 80 GB, 54 GB of weights, 128K tokens
    full = memory.max_concurrent_requests(80e9, "gemma-3-27b", "fp16", 131072, 54e9)
    budget = memory.max_concurrent_requests(80e9, "gemma-3-27b", "fp16", 131072, 54e9, budget_tokens=1024)
    assert (full, budget) == (2, int(26e9 // (1024 * 80 * 1024 + 52 * 1024 * 2 * 16 * 128 * 2)))
    # a model none of whose layers keeps keys (every one linear attention): no bytes, and no bound to compute
    recurrent = memory.KVShape("recurrent", 4, 2, 16, layer_kv=())
    assert memory.kv_cache_bytes(recurrent, "fp16", 1000) == 0 and memory.bytes_per_token(recurrent) == 0
    with pytest.raises(ValueError, match="recurrent holds no keys and values"):
        memory.max_concurrent_requests(80e9, recurrent)


def test_measured_bytes_next_to_theory():
    import torch
    from conftest import random_ids

    model = build_model("llama")
    ids = random_ids(1, 64, seed=2)
    rows = memory.measured_vs_theory(
        model, [("dynamic", "dynamic", {}), ("sink 16", "sink", {"sinks": 4, "budget": 16})], ids, decode_tokens=4
    )
    dyn, sink = rows
    per_token = 2 * 2 * 2 * 16 * 4
    assert dyn["theory_bytes"] == 64 * per_token and dyn["measured_bytes"] == dyn["theory_bytes"]
    assert sink["tokens_kept"] == 16 and sink["theory_bytes"] == 16 * per_token
    # + one trash slot per layer, slot metadata and the sinks' un-rotated copies
    assert 1.0 < sink["measured_over_theory"] < 2.0
    assert torch.get_num_threads() >= 1


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_theory_counts_hybrid_models_layer_by_layer(arch):
    """Gemma 3 (sliding layers of window 8 next to full layers) and Gemma 4 (its full layers with their own head_dim,
    two layers sharing earlier layers' keys and values): what DynamicCache holds after 40 tokens is the theory's
    dense bytes exactly (sliding layers hold their window, shared layers nothing), where counting every layer at
    every token overstated it; a sink cache's theory counts its budget on full layers only."""
    import model_zoo
    from conftest import random_ids

    model = model_zoo.build(arch)
    rows = memory.measured_vs_theory(
        model,
        [("dynamic", "dynamic", {}), ("sink 16", "sink", {"sinks": 4, "budget": 16})],
        random_ids(1, 40, seed=2),
        decode_tokens=4,
    )
    dyn, sink = rows
    layers = model.config.num_hidden_layers
    assert dyn["theory_bytes"] == dyn["dense_bytes"]
    assert 0 <= dyn["measured_bytes"] - dyn["theory_bytes"] <= 8 * layers  # (+ a layer's int64 counter tensor)
    every_layer_every_token = (
        2 * layers * memory.kv_head_count(model.config) * memory.attention_head_dim(model.config) * 4 * 40
    )
    assert dyn["dense_bytes"] < 0.7 * every_layer_every_token
    assert memory.kv_cache_bytes(memory.shape_from_config(model.config), "fp32", 40) == dyn["dense_bytes"]
    window = memory.kv_cache_bytes(model.config, "fp32", 40, kept=0)  # the sliding layers alone
    assert window > 0 and sink["theory_bytes"] - window == (dyn["theory_bytes"] - window) * 16 / 40


def test_report_only_writes_reports_without_running(tmp_path):
    from hf_kvcache.evaluation.sweep import run_sweep

    spec = {
        "name": "ro",
        "model": "tiny",
        "context_lengths": [16],
        "scored_tokens": 4,
        "metrics": ["quality"],
        "budgets": [8],
        "caches": [{"name": "dynamic"}, {"name": "sliding", "budget_key": "window"}],
    }
    calls = []

    def loader(name, dtype):
        calls.append(name)
        raise AssertionError("report_only must not load a model")

    rows = run_sweep(spec, tmp_path, loader=loader, report_only=True, progress=False)
    assert rows == [] and calls == []
    assert (tmp_path / "ro" / "results.csv").is_file()


def test_summary_tables_one_per_metric_present():
    """format_summary: a markdown table per metric that has rows (in SUMMARY_TABLES order), none for the others."""
    from hf_kvcache.evaluation.sweep_results import format_summary

    rows = [
        {
            "metric": "retrieval",
            "context_len": 2048,
            "kind": "passkey",
            "position": "early",
            "label": "h2o",
            "exact_match": 1.0,
            "parse_rate": 1.0,
            "value_match": 0.5,
        },
        {
            "metric": "quality",
            "context_len": 2048,
            "label": "dynamic",
            "budget_tokens": None,
            "bytes_held": 2**20,
            "bytes_vs_dense": 1.0,
            "ppl": 11.5,
            "ppl_ref": 11.5,
            "kl_mean": 0.0,
            "kl_p99": 0.0,
            "top1_agreement": 1.0,
            "top5_agreement": 1.0,
        },
    ]
    assert format_summary(rows).split("\n") == [
        "| n | cache | tokens kept | bytes held | vs dense | PPL | PPL full | KL mean | KL p99 | top-1 | top-5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| 2048 | dynamic | all | 1.0 MiB | 1.00 | 11.50 | 11.50 | 0.0000 | 0.000 | 1.000 | 1.000 |",
        "",
        "| n | probe | position | cache | exact | JSON parse | value match |",
        "|---|---|---|---|---|---|---|",
        "| 2048 | passkey | early | h2o | 1.00 | 1.00 | 0.50 |",
        "",
    ]
