"""H2OCache: equality with the full cache within budget, scores and kept sets against a reference built from eager
attention probabilities, padding, flat memory, chunked prefill, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_pad, random_ids
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import cache_kwargs, returned_cache


def _stream_logits(model, cache, ids, prefill):
    outs = [model(input_ids=ids[:, :prefill], **cache_kwargs(cache), use_cache=True).logits]
    for i in range(prefill, ids.shape[1]):
        outs.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
def test_budget_at_least_sequence_equals_dynamic_cache(arch):
    model = build_model(arch)
    ids = random_ids(2, 30)
    with torch.no_grad():
        ref = _stream_logits(model, DynamicCache(config=model.config), ids, 12)
        got = _stream_logits(model, hf_kvcache.H2OCache(model, heavy=16, recent=16), ids, 12)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _kept(cache, layer_idx):
    """{(row, head): {stream index: score}} of the valid slots of a layer."""
    layer = cache.layers[layer_idx]
    valid, stream, scores = layer.slot_valid, layer.policy.stream, layer.policy.scores
    out = {}
    for b in range(valid.shape[0]):
        for h in range(valid.shape[1]):
            sel = valid[b, h, : layer.used]
            out[(b, h)] = dict(zip(stream[b, h, : layer.used][sel].tolist(), scores[b, h, : layer.used][sel].tolist()))
    return out


@pytest.mark.parametrize(
    "aggregation,attention_score",
    [("sum", "accumulated"), ("mean", "accumulated"), ("max", "accumulated"), ("sum", "average")],
)
def test_scores_and_kept_sets_match_eager_reference(aggregation, attention_score):
    """Reference: eager attention probabilities (output_attentions=True) mapped to tokens by stream index,
    aggregated over each KV group, accumulated in plain Python, and the H2O rule applied with sets (ranked by the
    accumulated score, or by it over the number of queries that saw the token: kvpress's ObservedAttention)."""
    heavy, recent, prefill, steps = 4, 3, 12, 20
    model = build_model("llama", attn="eager")
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = random_ids(1, prefill + steps, seed=3)
    cache = hf_kvcache.H2OCache(
        model, heavy=heavy, recent=recent, aggregation=aggregation, attention_score=attention_score
    )

    def rank(score: float, t: int, now: int) -> float:  # `now` queries so far: t was seen by now - t of them
        return score / max(now - t, 1) if attention_score == "average" else score

    layers = model.config.num_hidden_layers
    agg = {"sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0)}[aggregation]
    reference = [{h: {} for h in range(model.config.num_key_value_heads)} for _ in range(layers)]

    with torch.no_grad():
        # Prefill longer than the budget: columns are the prompt tokens 0..prefill-1.
        out = model(input_ids=ids[:, :prefill], **cache_kwargs(cache), use_cache=True, output_attentions=True)
        for layer in range(layers):
            probs = out.attentions[layer][0].float().sum(1)  # [Hq, kv] summed over queries
            for h in reference[layer]:
                col = agg(probs[h * groups : (h + 1) * groups])
                scores = {t: float(col[t]) for t in range(prefill)}
                recent_set = {t for t in scores if t >= prefill - recent}
                rest = sorted((t for t in scores if t not in recent_set), key=lambda t: -rank(scores[t], t, prefill))
                rest = rest[:heavy]
                reference[layer][h] = {t: scores[t] for t in recent_set | set(rest)}
        for layer in range(layers):
            kept = _kept(cache, layer)
            for h, ref in reference[layer].items():
                assert set(kept[(0, h)]) == set(ref)
                for t, s in ref.items():
                    assert kept[(0, h)][t] == pytest.approx(s, rel=1e-4, abs=1e-6)

        for step in range(prefill, prefill + steps):
            # The rule applied before attention: evict the lowest-scoring token outside the new recent window.
            for layer in range(layers):
                for ref in reference[layer].values():
                    if len(ref) >= heavy + recent:
                        candidates = [t for t in ref if t <= step - recent]
                        del ref[min(candidates, key=lambda t: rank(ref[t], t, step))]
                    ref[step] = 0.0
            stream_before = [cache.layers[i].policy.stream.clone() for i in range(layers)]
            out = model(
                input_ids=ids[:, step : step + 1], **cache_kwargs(cache), use_cache=True, output_attentions=True
            )
            for layer in range(layers):
                used = cache.layers[layer].used
                probs = out.attentions[layer][0, :, 0].float()  # [Hq, kv]
                stream = cache.layers[layer].policy.stream[0, :, :used]
                for h, ref in reference[layer].items():
                    col = agg(probs[h * groups : (h + 1) * groups])
                    for slot, t in enumerate(stream[h].tolist()):
                        if t in ref:
                            ref[t] += float(col[slot])
                kept = _kept(cache, layer)
                for h, ref in reference[layer].items():
                    assert set(kept[(0, h)]) == set(ref), f"step {step} layer {layer} head {h}"
                    for t, s in ref.items():
                        assert kept[(0, h)][t] == pytest.approx(s, rel=1e-4, abs=1e-6)
            assert stream_before[0].shape == cache.layers[0].policy.stream.shape


def test_heads_keep_different_token_sets():
    model = build_model("llama")
    cache = hf_kvcache.H2OCache(model, heavy=4, recent=2)
    with torch.no_grad():
        _stream_logits(model, cache, random_ids(1, 40, seed=5), 10)
    layer = cache.layers[0]
    sets = [frozenset(layer.policy.stream[0, h, :-1][layer.slot_valid[0, h, :-1]].tolist()) for h in range(2)]
    assert all(len(s) == 6 for s in sets)
    assert all({38, 39} <= s for s in sets)  # the recent window is in every head
    assert sets[0] != sets[1]  # but the heavy hitters are chosen per head


def test_left_padding_matches_rows_alone_after_eviction():
    model = build_model("llama")
    rows = [random_ids(1, 25, seed=1)[0], random_ids(1, 13, seed=2)[0], random_ids(1, 19, seed=4)[0]]
    ids, mask = left_pad(rows)
    config = {"heavy": 5, "recent": 4}
    with torch.no_grad():
        batched = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=15,
            min_new_tokens=15,
            do_sample=False,
            cache_implementation="h2o",
            cache_config=config,
        )
        for i, row in enumerate(rows):
            alone = model.generate(
                row[None],
                max_new_tokens=15,
                min_new_tokens=15,
                do_sample=False,
                cache_implementation="h2o",
                cache_config=config,
            )
            assert batched[i, ids.shape[1] :].tolist() == alone[0, row.numel() :].tolist()


def test_padding_is_never_a_heavy_hitter():
    model = build_model("llama")
    ids, mask = left_pad([random_ids(1, 20, seed=1)[0], random_ids(1, 6, seed=2)[0]])
    cache = hf_kvcache.H2OCache(model, heavy=6, recent=2)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    layer = cache.layers[0]
    kept_stream = layer.policy.stream[1, :, :-1][layer.slot_valid[1, :, :-1]]
    assert kept_stream.numel() == 6 * layer.slot_valid.shape[1]  # all 6 real tokens, per head
    assert (kept_stream >= 14).all()  # stream indices 0..13 are padding


def test_memory_flat_at_budget_during_long_decode():
    model = build_model("llama")
    cache = hf_kvcache.H2OCache(model, heavy=8, recent=8)
    ids = random_ids(1, 120, seed=7)
    sizes, shapes = [], []
    with torch.no_grad():
        model(input_ids=ids[:, :20], **cache_kwargs(cache), use_cache=True)
        for i in range(20, 120):
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
            sizes.append(cache.nbytes())
            shapes.append(tuple(cache.layers[0].store.keys.shape))
    assert len(set(sizes)) == 1 and len(set(shapes)) == 1
    layer = cache.layers[0]
    expected = sum(
        t.nbytes
        for t in (
            layer.store.keys,
            layer.store.values,
            layer.slot_pos,
            layer.slot_valid,
            layer.policy.scores,
            layer.policy.stream,
        )
    )
    assert sizes[0] == expected * model.config.num_hidden_layers
    assert layer.store.keys.shape[2] == 17  # 16 slots + the trash slot


def test_chunked_prefill_keeps_memory_near_budget_and_generates():
    model = build_model("llama")
    ids = random_ids(1, 64, seed=9)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            cache_implementation="h2o",
            cache_config={"heavy": 6, "recent": 6},
            prefill_chunk_size=8,
            return_dict_in_generate=True,
        )
    cache = returned_cache(out)
    assert cache.get_seq_length() == 64 + 7
    assert cache.layers[0].store.keys.shape[2] == 13
    assert int(cache.layers[0].slot_valid[0, 0].sum()) == 12


def test_ratios_resolve_against_the_prompt():
    model = build_model("llama")
    cache = hf_kvcache.H2OCache(model, heavy=0.2, recent=0.1)
    with torch.no_grad():
        model(input_ids=random_ids(1, 50), **cache_kwargs(cache), use_cache=True)
    assert cache.layers[0].policy.capacity == 15
    assert int(cache.layers[0].slot_valid[0, 0].sum()) == 15


def test_budget_split_and_generate_registration():
    model = build_model("llama")
    cache = hf_kvcache.H2OCache(model.config, budget=10)
    assert (cache.heavy, cache.recent) == (5, 5)
    assert hf_kvcache.CACHE_IMPLEMENTATIONS["h2o"] is hf_kvcache.H2OCache
    with torch.no_grad():
        a = model.generate(
            random_ids(1, 12),
            max_new_tokens=6,
            do_sample=False,
            num_beams=2,
            cache_implementation="h2o",
            cache_config={"budget": 40},
        )
        b = model.generate(random_ids(1, 12), max_new_tokens=6, do_sample=False, num_beams=2)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"heavy": 8, "recent": 8, "budget": 10}, "budget"),
        ({"heavy": -1, "recent": 4}, "heavy"),
        ({"heavy": 4, "recent": -2}, "recent"),
        ({"heavy": 1.5, "recent": 4}, "heavy"),
        ({"heavy": 0.0, "recent": 4}, "heavy"),
        ({"heavy": 4, "recent": 0.1, "budget": 20}, "budget"),
        ({"heavy": 0, "recent": 0}, "at least 1"),
        ({"heavy": 4}, "recent"),
        ({"budget": 0}, "budget"),
        ({"budget": 8, "aggregation": "median"}, "aggregation"),
        ({"heavy": "4", "recent": 4}, "heavy"),
    ],
)
def test_bad_input(kwargs, match):
    model = build_model("llama")
    with pytest.raises(ValueError, match=match):
        hf_kvcache.H2OCache(model.config, **kwargs)


def test_crop_before_eviction_and_error_after():
    model = build_model("llama")
    ids = random_ids(1, 30)
    cache = hf_kvcache.H2OCache(model, heavy=10, recent=10)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :15], **cache_kwargs(cache), use_cache=True)
        model(input_ids=ids[:, :15], **cache_kwargs(ref), use_cache=True)
        cache.crop(-3)
        ref.crop(-3)
        got = model(input_ids=ids[:, 12:14], **cache_kwargs(cache), use_cache=True).logits
        want = model(input_ids=ids[:, 12:14], **cache_kwargs(ref), use_cache=True).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        model(input_ids=ids[:, 14:30], **cache_kwargs(cache), use_cache=True)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(-1)


def test_random_eviction_keeps_recent_window_and_a_random_rest():
    model = build_model("llama")
    ids = random_ids(1, 60, seed=11)
    kept = []
    for seed in (0, 1):
        cache = hf_kvcache.RandomEvictionCache(model, heavy=6, recent=4, seed=seed)
        with torch.no_grad():
            _stream_logits(model, cache, ids, 20)
        layer = cache.layers[0]
        sets = [frozenset(layer.policy.stream[0, h, :-1][layer.slot_valid[0, h, :-1]].tolist()) for h in range(2)]
        assert all(len(s) == 10 and {56, 57, 58, 59} <= s for s in sets)
        kept.append(sets)
    assert kept[0] != kept[1]  # the seed matters
    with torch.no_grad():
        a = model.generate(
            ids[:, :20],
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="random_eviction",
            cache_config={"budget": 40},
        )
        b = model.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
    assert a.tolist() == b.tolist()  # within budget nothing is evicted


def test_random_eviction_prefill_longer_than_budget_and_padding():
    model = build_model("llama")
    rows = [random_ids(1, 30, seed=1)[0], random_ids(1, 12, seed=2)[0]]
    ids, mask = left_pad(rows)
    cache = hf_kvcache.RandomEvictionCache(model, heavy=5, recent=3)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    layer = cache.layers[0]
    for row, real_start in ((0, 0), (1, 18)):
        kept = layer.policy.stream[row, :, :-1][layer.slot_valid[row, :, :-1]]
        assert kept.numel() == 8 * 2 and bool((kept >= real_start).all())


def _kept_sets(cache) -> list[list[list[frozenset]]]:
    """Per layer, row and KV head: the stream indices of the tokens kept."""
    return [
        [
            [
                frozenset(layer.policy.stream[b, h, :-1][layer.slot_valid[b, h, :-1]].tolist())
                for h in range(layer.slot_valid.shape[1])
            ]
            for b in range(layer.slot_valid.shape[0])
        ]
        for layer in cache.layers
    ]


def _feed(cache, heads: slice, steps, seed=0):
    """Prefill 20 tokens (evicting: budget 10), then decode 15, straight into the layers (random eviction needs no
    attention), giving each layer the KV heads `heads` of the same random keys and values."""
    g = torch.Generator().manual_seed(seed)
    for q in steps:
        cache.begin_forward(q, 2, torch.device("cpu"))
        for layer in cache.layers:
            keys = torch.randn(2, 4, q, 16, generator=g)
            layer.update(keys[:, heads], keys[:, heads] + 1)


def test_random_eviction_draws_per_global_kv_head_and_seed():
    """The random key of a token is a function of (seed, row, global KV head, stream index): a cache holding only KV
    heads 2..3 (tensor-parallel rank 1 of 2: head offset 2) keeps exactly what a single process keeps in heads 2..3,
    and rank 0 what it keeps in heads 0..1; the same seed gives the same choices, another seed others."""
    from hf_kvcache.common.tensor_parallel import TensorParallel

    config = build_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=16).config
    steps = [20] + [1] * 15
    caches = {}
    for name, seed, rank, heads in (
        ("full", 0, 0, slice(0, 4)),
        ("again", 0, 0, slice(0, 4)),
        ("other_seed", 7, 0, slice(0, 4)),
        ("rank0", 0, 0, slice(0, 2)),
        ("rank1", 0, 1, slice(2, 4)),
    ):
        cache = hf_kvcache.RandomEvictionCache(config, heavy=6, recent=4, seed=seed)
        assert cache.tensor_parallel.size == 1  # a config-only cache: single process, head offset 0
        if name.startswith("rank"):
            for layer in cache.layers:
                layer.policy.scorer.tensor_parallel = TensorParallel(rank=rank, size=2, kv_heads=4)
        _feed(cache, heads, steps)
        caches[name] = _kept_sets(cache)
    full = caches["full"]
    assert all(len(s) == 10 for layer in full for row in layer for s in row)
    assert caches["again"] == full
    assert caches["other_seed"] != full
    assert caches["rank0"] == [[row[:2] for row in layer] for layer in full]
    assert caches["rank1"] == [[row[2:] for row in layer] for layer in full]
    assert full[0][0][0] != full[0][0][2]  # heads draw differently (else the rank check would prove nothing)


def test_random_eviction_decode_compiles_to_one_graph():
    """No generator state: a decode step compiles with fullgraph=True and equals eager."""
    torch._dynamo.reset()
    model = build_model("llama")
    hf_kvcache.enable(model)
    ids = random_ids(2, 24, seed=3)
    outputs = []
    for forward in (model.forward, torch.compile(model.forward, fullgraph=True, backend="eager")):
        cache = hf_kvcache.RandomEvictionCache(model, heavy=4, recent=4)
        with torch.no_grad():
            model(input_ids=ids[:, :8], **cache_kwargs(cache))  # prefill eager, as generate does
            outputs.append(
                torch.cat(
                    [
                        forward(
                            input_ids=ids[:, i : i + 1], position_ids=torch.full((2, 1), i), **cache_kwargs(cache)
                        ).logits
                        for i in range(8, 24)
                    ],
                    1,
                )
            )
    assert cache.is_compileable
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


def _rope(x, positions, theta, dim):
    """Reference RoPE (rotate-half), written out: x [n, D] rotated to `positions` [n]."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = positions.double()[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    rot = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)
    return (x.double() * cos + rot.double() * sin).float()


def test_compact_positions_place_kept_keys_contiguously_before_the_newest():
    """Layer-0 keys do not depend on the cache, so the reference takes them from a DynamicCache run, un-rotates them
    (rotation by -p), and rotates each kept token to rank-based contiguous positions ending at the newest."""
    model = build_model("llama")
    ids = random_ids(1, 40, seed=12)
    cache = hf_kvcache.H2OCache(model, heavy=5, recent=3, position_mode="compact")
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        _stream_logits(model, cache, ids, 10)
        model(input_ids=ids, **cache_kwargs(full), use_cache=True)
    layer, dim = cache.layers[0], model.config.hidden_size // model.config.num_attention_heads
    theta = model.config.rope_parameters["rope_theta"]
    all_keys = full.layers[0].keys[0]  # [H, 40, D] at positions 0..39
    for h in range(all_keys.shape[0]):
        valid = layer.slot_valid[0, h, : layer.used]
        stream = layer.policy.stream[0, h, : layer.used][valid]
        kept = sorted(stream.tolist())
        assert len(kept) == 8 and kept[-3:] == [37, 38, 39]
        targets = torch.tensor([39 - 7 + kept.index(t) for t in stream.tolist()])
        original = _rope(all_keys[h, stream], -stream, theta, dim)  # back to position 0
        want = _rope(original, targets, theta, dim)
        torch.testing.assert_close(layer.store.keys[0, h, : layer.used][valid], want, atol=1e-5, rtol=1e-4)


def test_compact_positions_change_outputs_only_after_eviction():
    model = build_model("llama")
    ids = random_ids(1, 30, seed=13)
    with torch.no_grad():
        a = _stream_logits(model, hf_kvcache.H2OCache(model, heavy=4, recent=4, position_mode="compact"), ids, 4)
        b = _stream_logits(model, hf_kvcache.H2OCache(model, heavy=4, recent=4), ids, 4)
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-5, rtol=1e-5)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="position_mode"):
        hf_kvcache.H2OCache(model.config, budget=8, position_mode="packed")
