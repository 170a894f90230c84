"""torch.compile through our fixed-capacity caches (CPU, inductor): full graphs, no recompilation after warm-up,
outputs equal to eager decode.

Fixed-capacity layers return all `capacity` slots in every decode step (the empty ones masked) and index their
slots with tensors, so decode shapes are constant; the only recompilations are the warm-up ones where the cache
turns from filling to full (Python-level facts such as `seen > capacity`)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_kvcache
from hf_kvcache import cache_kwargs

CACHES = {
    "sink": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=10),
    "sliding": lambda m: hf_kvcache.SlidingWindowCache(m, window=12),
    "h2o": lambda m: hf_kvcache.H2OCache(m, heavy=6, recent=6),
}
PROMPT, STEPS, WARMUP = 8, 16, 8  # the cache fills and evicts within the warm-up steps


def _decode(model, cache, forward):
    ids = random_ids(2, PROMPT)
    logits, graphs = [], []
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache))  # prefill runs eager, as in generate
        token = out.logits[:, -1:].argmax(-1)
        for step in range(STEPS):
            positions = torch.full((2, 1), PROMPT + step)
            out = forward(input_ids=token, position_ids=positions, **cache_kwargs(cache))
            logits.append(out.logits)
            graphs.append(counters["stats"]["unique_graphs"])
            token = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1), graphs


@pytest.mark.parametrize("name", sorted(CACHES))
def test_compiled_decode_equals_eager_without_recompiling(name):
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    assert CACHES[name](model).is_compileable
    eager, _ = _decode(model, CACHES[name](model), model.forward)
    counters.clear()
    compiled, graphs = _decode(model, CACHES[name](model), torch.compile(model.forward, fullgraph=True))
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    assert graphs[WARMUP:] == [graphs[WARMUP]] * (STEPS - WARMUP), graphs  # no recompilation after warm-up
    assert graphs[-1] <= 5


def _teacher_forced(model, cache, forward, steps=STEPS):
    """Decode logits for a fixed token sequence (the same in every run: no divergence from a flipped argmax)."""
    logits, graphs = [], []
    with torch.no_grad():
        model(input_ids=random_ids(2, PROMPT), **cache_kwargs(cache))
        for step in range(steps):
            out = forward(
                input_ids=random_ids(2, 1, seed=step),
                position_ids=torch.full((2, 1), PROMPT + step),
                **cache_kwargs(cache),
            )
            logits.append(out.logits)
            graphs.append(counters["stats"]["unique_graphs"])
    return torch.cat(logits, 1), graphs


def _eager_and_compiled(model, make, warmup=WARMUP):
    """Teacher-forced decode logits of a fresh `make()` cache, eager then compiled (full graph), after checking that
    the cache says it compiles; asserts no recompilation after `warmup` steps. Returns (compiled, eager)."""
    assert make().is_compileable
    eager, _ = _teacher_forced(model, make(), model.forward)
    counters.clear()
    compiled, graphs = _teacher_forced(model, make(), torch.compile(model.forward, fullgraph=True))
    assert graphs[warmup:] == [graphs[warmup]] * (STEPS - warmup), graphs  # no recompilation after warm-up
    return compiled, eager


@pytest.mark.parametrize("granularity", ["head", "token"])
def test_fp8_with_max_length_compiles(granularity):
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    make = lambda: hf_kvcache.QuantizedFP8Cache(model, granularity=granularity, max_length=PROMPT + STEPS)
    compiled, eager = _eager_and_compiled(model, make, warmup=2)
    if granularity == "head":  # fixed scales: the compiled step computes the very same codes
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    else:  # per-token scales: inductor's x / scale rounds a rare FP8 tie the other way (measured KL ~1e-4)
        kl = torch.nn.functional.kl_div(
            compiled.log_softmax(-1), eager.log_softmax(-1), log_target=True, reduction="none"
        ).sum(-1)
        assert kl.mean() < 1e-3 and (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9


HYBRID_CACHES = {
    "sink": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=10),
    "fp8_head": lambda m: hf_kvcache.QuantizedFP8Cache(m, granularity="head", max_length=PROMPT + STEPS),
}


@pytest.mark.parametrize("name", sorted(HYBRID_CACHES))
def test_hybrid_model_with_kv_sharing_compiles(name):
    """Gemma 4 (sliding and full layers of two head sizes; its last two layers attend to what earlier layers cached):
    its sliding layers are StaticCache's under a fixed-capacity cache, so the whole cache is compileable, and a KV
    sharing layer finds the layer it reuses from the config, not from the tensor it is handed (dynamo cannot compare
    ids). Full graph, no recompilation after the sliding window and the cache have filled, eager's logits."""
    import model_zoo

    torch._dynamo.reset()
    model = model_zoo.build("gemma4")
    hf_kvcache.enable(model)
    make = lambda: HYBRID_CACHES[name](model)
    compiled, eager = _eager_and_compiled(model, make)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


KIVI_FIXED = dict(group_size=4, residual=6)  # blocks complete in prefill and in decode, the residual stays in a ring


def test_kivi_with_max_length_compiles_and_equals_eager():
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    make = lambda: hf_kvcache.KIVICache(model, max_length=PROMPT + STEPS, **KIVI_FIXED)
    compiled, eager = _eager_and_compiled(model, make, warmup=2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize(
    "settings", [KIVI_FIXED, dict(group_size=8, residual=0, bits=2), dict(group_size=4, residual=5, key_smoothing=True)]
)
def test_kivi_fixed_layout_equals_the_growing_one(settings):
    """The ring layout quantizes the same blocks at the same steps as the growing layout: same logits (up to the
    masked empty columns it also attends over), same split of quantized / full-precision tokens."""
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    growing, fixed = hf_kvcache.KIVICache(model, **settings), hf_kvcache.KIVICache(model, max_length=40, **settings)
    expected, _ = _teacher_forced(model, growing, model.forward, steps=24)
    got, _ = _teacher_forced(model, fixed, model.forward, steps=24)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for i, (a, b) in enumerate(zip(growing.layers, fixed.layers)):
        assert (b.store.qlen, b.store.fp_len) == (a.store.qlen, a.store.fp_len) and b.store.qlen > 0
        keys, values = (t.clone() for t in a.store.read(a.store.length))
        fixed_keys, fixed_values = b.store.read(b.store.length)
        torch.testing.assert_close((fixed_keys, fixed_values), (keys, values), atol=1e-4, rtol=1e-4)
        # layer 0 sees the same inputs in both runs (deeper layers get activations that differ in the last bits):
        # the very same codes and residual, unless smoothing (the mean is the prompt's here, the first block's there)
        if i == 0 and not settings.get("key_smoothing"):
            assert torch.equal(fixed_keys, keys) and torch.equal(fixed_values, values)


GENERATED = {  # cache_implementation, cache_config
    "sink": ("sink", {"sinks": 2, "window": 10}),
    "kivi_max_length": ("kivi", {**KIVI_FIXED, "max_length": PROMPT + 16}),
    "composite": ("composite", {"preset": "sinks_heavy_recent", "budget": 12}),
}


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generate_with_compile_config(name):
    """generate compiles a compileable cache by itself on accelerators (here forced on the CPU): greedy tokens equal
    eager generate's, and a second generate reuses the graphs."""
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # transformers compiles automatically on accelerators; on CPU when asked
    implementation, cache_config = GENERATED[name]
    kwargs = dict(
        input_ids=random_ids(2, PROMPT),
        max_new_tokens=16,
        do_sample=False,
        cache_implementation=implementation,
        cache_config=cache_config,
    )
    eager = model.generate(**kwargs)
    counters.clear()
    first = model.generate(**kwargs, compile_config=config)
    graphs = counters["stats"]["unique_graphs"]
    again = model.generate(**kwargs, compile_config=config)
    assert graphs >= 1  # it did compile
    assert counters["stats"]["unique_graphs"] == graphs  # a second generate reuses the graphs
    assert torch.equal(first, eager) and torch.equal(again, eager)


def test_kivi_max_length_refuses_hqq_and_blockwise_by_name():
    model = build_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="`backend` 'hqq'.*max_length"):
        hf_kvcache.KIVICache(model, max_length=32, backend="hqq")
    with pytest.raises(ValueError, match="`attention`='blockwise'.*max_length"):
        hf_kvcache.KIVICache(model, max_length=32, group_size=4, attention="blockwise")
    cache = hf_kvcache.KIVICache(model, max_length=10, group_size=4, residual=2)
    with torch.no_grad():
        model(input_ids=random_ids(1, 10), **cache_kwargs(cache))
        with pytest.raises(ValueError, match="max_length"):
            model(input_ids=random_ids(1, 1), **cache_kwargs(cache))


def test_fp8_max_length_is_a_hard_limit_with_a_clear_error():
    model = build_model("llama", num_hidden_layers=1)
    cache = hf_kvcache.QuantizedFP8Cache(model, max_length=10)
    with torch.no_grad():
        model(input_ids=random_ids(1, 10), **cache_kwargs(cache))
        with pytest.raises(ValueError, match="max_length"):
            model(input_ids=random_ids(1, 1), **cache_kwargs(cache))
    with pytest.raises(ValueError, match="max_length.*residual=0"):
        hf_kvcache.QuantizedFP8Cache(model, max_length=10, residual=4)
    with pytest.raises(ValueError, match="max_length"):
        hf_kvcache.QuantizedFP8Cache(model, max_length=0)


def test_growing_caches_say_they_are_not_compileable():
    model = build_model("llama", num_hidden_layers=2)
    rest = [{"role": "window", "start": 0, "end": 4}, {"role": "rest", "keys": "fp8_e4m3", "values": "fp8_e4m3"}]
    for cache in (
        hf_kvcache.QuantizedFP8Cache(model),
        hf_kvcache.KIVICache(model, group_size=16),
        hf_kvcache.CompositeCache(model, regions=rest),
        hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=12, compress="prompt"),
        hf_kvcache.FullCache(model),
    ):
        assert not cache.is_compileable  # generate then runs them eagerly instead of compiling them
    assert hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=12).is_compileable  # a fixed budget


def composite_regions(precision, scorer: str, **options) -> list[dict]:
    """2 full-precision sinks, a 5-token window and 5 heavy hitters at `precision`: full by the 12th token."""
    return [
        {"role": "sinks", "tokens": 2},
        {"role": "window", "start": 0, "end": 5, "keys": precision, "values": precision},
        {"role": "heavy", "tokens": 5, "keys": precision, "values": precision, "scorer": scorer, **options},
    ]


@pytest.mark.parametrize("attention", ["dequantize", "blockwise"])
def test_composite_compiles_and_equals_eager(attention):
    """Full-precision sinks + FP8 window and heavy hitters (fixed per-head scales: the compiled step computes the very
    same codes) ranked by SnapKV: a full graph, no recompilation once the cache is full, eager's logits. "blockwise"
    is what a GPU compiles ("auto" there): attention from the codes by the torch block path, traced whole."""
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    fp8_head = {"format": "fp8_e4m3", "granularity": "head"}
    make = lambda: hf_kvcache.CompositeCache(
        model, regions=composite_regions(fp8_head, "snapkv", window=3), attention=attention
    )
    compiled, eager = _eager_and_compiled(model, make)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_composite_with_per_token_fp8_compiles():
    """Per-token FP8 scales (the preset's) and H2O: inductor's x / scale rounds a rare FP8 tie the other way, and a
    heavy hitter chosen from such scores may differ; measured KL 1.1e-3, argmax 97% equal (teacher-forced)."""
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    make = lambda: hf_kvcache.CompositeCache(model, regions=composite_regions("fp8_e4m3", "h2o"))
    compiled, eager = _eager_and_compiled(model, make)
    kl = torch.nn.functional.kl_div(
        compiled.log_softmax(-1), eager.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert kl.mean() < 3e-3 and (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9


def test_compiling_a_growing_cache_is_a_clear_error():
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=1)
    hf_kvcache.enable(model)
    cache = hf_kvcache.KIVICache(model, group_size=16)
    with torch.no_grad():
        model(input_ids=random_ids(1, 6), **cache_kwargs(cache))
        with pytest.raises(Exception, match="not compileable"):
            torch.compile(model.forward, fullgraph=True)(input_ids=random_ids(1, 1), **cache_kwargs(cache))


SIZED = {  # two configurations of each compileable cache kind, decoded through one compiled forward
    "h2o": lambda m, n: hf_kvcache.H2OCache(m, heavy=n, recent=n),
    "sink": lambda m, n: hf_kvcache.SinkCache(m, sinks=2, window=2 * n),
    "fp8_max_length": lambda m, n: hf_kvcache.QuantizedFP8Cache(m, max_length=PROMPT + STEPS + n),
    "composite": lambda m, n: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=4 * n),
    "sliding": lambda m, n: hf_kvcache.SlidingWindowCache(m, window=2 * n),
    "random": lambda m, n: hf_kvcache.RandomEvictionCache(m, heavy=n, recent=n),
    "kivi_max_length": lambda m, n: hf_kvcache.KIVICache(m, max_length=PROMPT + STEPS + 4 * n, **KIVI_FIXED),
    "composite_snapkv": lambda m, n: hf_kvcache.CompositeCache(
        m,
        regions=composite_regions("fp8_e4m3", "snapkv", window=n)[:2]
        + [{"role": "heavy", "tokens": n, "keys": "fp8_e4m3", "values": "fp8_e4m3", "scorer": "snapkv", "window": n}],
    ),
    "composite_keydiff_codes": lambda m, n: hf_kvcache.CompositeCache(  # attention from codes, scores from stored keys
        m,
        regions=composite_regions("fp8_e4m3", "keydiff")[:2]
        + [{"role": "heavy", "tokens": n, "keys": "fp8_e4m3", "values": "fp8_e4m3", "scorer": "keydiff"}],
        attention="blockwise",
    ),
}


@pytest.mark.parametrize("name", sorted(SIZED))
def test_a_second_budget_compiles_with_static_shapes(name):
    """A cache of another size through the same compiled forward (generate keeps its compiled forward on the model)
    gets graphs specialised to its sizes: every tensor the graph takes has a static shape
    (hf_kvcache.common.compile_static;
    dynamo would otherwise turn the budget and the buffers it sizes symbolic, and inductor's kernels over symbolic
    sizes measured 20x slower), and those graphs compute eager's logits."""
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    graphs = []

    def record(gm, example_inputs):  # dynamo's graphs and their inputs as traced (sizes maybe symbolic); no inductor
        values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        graphs.append([v for v in values if isinstance(v, torch.Tensor)])
        return gm.forward

    forward = torch.compile(model.forward, backend=record, fullgraph=True)
    _teacher_forced(model, SIZED[name](model, 3), forward)
    first = len(graphs)
    compiled, _ = _teacher_forced(model, SIZED[name](model, 5), forward)
    eager, _ = _teacher_forced(model, SIZED[name](model, 5), model.forward)
    assert len(graphs) > first  # the new sizes compiled graphs of their own...
    symbolic = [
        tuple(t.shape) for graph in graphs[first:] for t in graph if not all(isinstance(d, int) for d in t.shape)
    ]
    assert symbolic == []  # ...with no symbolic tensor size
    assert len(graphs) - first <= 3
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
