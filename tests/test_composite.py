"""CompositeCache: the other caches as composite configs (same outputs), padding, beams, JSON round trip,
flat memory, and clear errors for bad region configs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, left_pad, random_ids
from transformers import DynamicCache, GenerationConfig

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.scorers.registry import HEAVY_SCORERS, options_of

W = {"role": "window"}


def _stream(model, cache, ids, prefill):
    outs = [model(input_ids=ids[:, :prefill], **cache_kwargs(cache), use_cache=True).logits]
    for i in range(prefill, ids.shape[1]):
        outs.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
    return torch.cat(outs, 1)


EQUIVALENT = {
    "sliding": (lambda m: hf_kvcache.SlidingWindowCache(m, window=8), [{**W, "start": 0, "end": 8}], {}),
    "sliding_two_windows": (
        lambda m: hf_kvcache.SlidingWindowCache(m, window=8),
        [{**W, "start": 0, "end": 3}, {**W, "start": 3, "end": 8}],
        {},
    ),
    "sink_cache_positions": (
        lambda m: hf_kvcache.SinkCache(m, sinks=3, window=8),
        [{"role": "sinks", "tokens": 3}, {**W, "start": 0, "end": 8}],
        {},
    ),
    "sink_original_positions": (
        lambda m: hf_kvcache.SinkCache(m, sinks=3, window=8, position_mode="original"),
        [{"role": "sinks", "tokens": 3}, {**W, "start": 0, "end": 8}],
        {"sink_positions": "original"},
    ),
    "h2o": (
        lambda m: hf_kvcache.H2OCache(m, heavy=5, recent=4, attention_score="accumulated"),
        [{**W, "start": 0, "end": 4}, {"role": "heavy", "tokens": 5}],
        {},
    ),
    "h2o_mean": (
        lambda m: hf_kvcache.H2OCache(m, heavy=5, recent=4, aggregation="mean", attention_score="accumulated"),
        [{**W, "start": 0, "end": 1}, {**W, "start": 1, "end": 4}, {"role": "heavy", "tokens": 5}],
        {"aggregation": "mean"},
    ),
    "keep_all": (lambda m: DynamicCache(config=m.config), [{**W, "start": 0, "end": 5}, {"role": "rest"}], {}),
}


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
@pytest.mark.parametrize("prefill", [5, 20])
def test_other_caches_as_composite_configs(name, prefill):
    make, regions, extra = EQUIVALENT[name]
    model = build_model("llama")
    ids = random_ids(2, 50, seed=1)
    with torch.no_grad():
        want = _stream(model, make(model), ids, prefill)
        got = _stream(model, hf_kvcache.CompositeCache(model, regions=regions, **extra), ids, prefill)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


CLASSIC = [{"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 4}, {"role": "heavy", "tokens": 4}]


def test_classic_composite_left_padding_matches_rows_alone():
    model = build_model("llama")
    rows = [random_ids(1, 22, seed=1)[0], random_ids(1, 11, seed=2)[0]]
    ids, mask = left_pad(rows)
    kwargs = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        cache_implementation="composite",
        cache_config={"regions": CLASSIC},
    )
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], **kwargs)
            assert batched[i, ids.shape[1] :].tolist() == alone[0, row.numel() :].tolist()


def test_tiered_keep_all_left_padding_and_beams():
    model = build_model("qwen2")
    regions = [{**W, "start": 0, "end": 3}, {**W, "start": 3, "end": 9}, {"role": "rest"}]
    rows = [random_ids(1, 14, seed=3)[0], random_ids(1, 7, seed=4)[0]]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        got = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            cache_implementation="composite",
            cache_config={"regions": regions},
        )
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert got.tolist() == want.tolist()  # nothing evicted, all full precision: same as DynamicCache
        beams = model.generate(
            ids[:1],
            max_new_tokens=8,
            num_beams=2,
            do_sample=False,
            cache_implementation="composite",
            cache_config={"regions": CLASSIC},
        )
        sampled = model.generate(
            ids[:1],
            max_new_tokens=8,
            do_sample=True,
            num_return_sequences=2,
            cache_implementation="composite",
            cache_config={"regions": CLASSIC},
        )
    assert beams.shape == (1, ids.shape[1] + 8) and sampled.shape == (2, ids.shape[1] + 8)


def test_config_round_trips_through_json_and_generation_config(tmp_path):
    model = build_model("llama")
    config = {"regions": CLASSIC, "aggregation": "max"}
    assert json.loads(json.dumps(config)) == config
    GenerationConfig(cache_implementation="composite", cache_config=config).save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_config == config
    ids = random_ids(1, 20, seed=6)
    with torch.no_grad():
        a = model.generate(ids, generation_config=loaded, max_new_tokens=8, do_sample=False)
        b = model.generate(
            ids, max_new_tokens=8, do_sample=False, cache_implementation="composite", cache_config=config
        )
    assert a.tolist() == b.tolist()
    cache = hf_kvcache.CompositeCache(model.config, **config)
    assert cache.regions == CLASSIC and cache.aggregation == "max"


def test_memory_flat_with_eviction_and_growth_only_in_rest():
    model = build_model("llama")
    ids = random_ids(1, 90, seed=8)
    bounded = hf_kvcache.CompositeCache(model, regions=CLASSIC)
    growing = hf_kvcache.CompositeCache(model, regions=[{**W, "start": 0, "end": 4}, {"role": "rest"}])
    sizes = []
    with torch.no_grad():
        model(input_ids=ids[:, :10], **cache_kwargs(bounded), use_cache=True)
        model(input_ids=ids[:, :10], **cache_kwargs(growing), use_cache=True)
        for i in range(10, 90):
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(bounded), use_cache=True)
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(growing), use_cache=True)
            sizes.append(bounded.nbytes())
    assert len(set(sizes)) == 1
    assert bounded.layers[0].store.nbytes() == 2 * 4 * sum(  # float32 keys + values, regions + their trash slots
        s.keys.numel() for s in bounded.layers[0].store.stores
    )
    assert int(growing.layers[0].slot_valid[0, 0].sum()) == 90
    assert growing.nbytes() > bounded.nbytes()


@pytest.mark.parametrize(
    "regions, match",
    [
        ([], "non-empty"),
        ([{"role": "sinks", "tokens": 4}], "window"),
        ([{**W, "start": 0, "end": 8}, {**W, "start": 4, "end": 12}], "overlaps"),
        ([{**W, "start": 0, "end": 8}, {**W, "start": 10, "end": 12}], "gap"),
        ([{**W, "start": 2, "end": 8}], "gap"),
        ([{**W, "start": 0, "end": 8}, {"role": "heavy", "tokens": 4}, {"role": "rest"}], "only one"),
        ([{**W, "start": 0, "end": 8}, {"role": "teleport"}], "role"),
        ([{**W, "start": 0, "end": 8, "size": 3}], "size"),
        ([{**W, "start": 5, "end": 5}], "end"),
        ([{**W, "start": 0, "end": 8}, {"role": "heavy", "tokens": 0}], "tokens"),
        ([{**W, "start": 0, "end": 8, "keys": "fp9"}], "keys|fp9"),
        ("window", "list"),
    ],
)
def test_bad_region_configs(regions, match):
    model = build_model("llama")
    with pytest.raises(ValueError, match=match):
        hf_kvcache.CompositeCache(model.config, regions=regions)


def test_unknown_cache_config_key_lists_valid_keys():
    model = build_model("llama")
    with pytest.raises(ValueError, match="regions"):
        model.generate(
            random_ids(1, 5),
            max_new_tokens=2,
            cache_implementation="composite",
            cache_config={"regions": CLASSIC, "budget": 8},
        )


def test_preset_expands_to_regions_and_checks_its_arguments():
    model = build_model("llama")
    cache = hf_kvcache.CompositeCache(model.config, preset="sinks_heavy_recent", budget=20, precision="full")
    assert cache.regions == [
        {"role": "sinks", "tokens": 4},
        {"role": "window", "start": 0, "end": 8, "keys": "full", "values": "full"},
        {"role": "heavy", "tokens": 8, "keys": "full", "values": "full"},
    ]
    for kwargs, match in [
        ({"preset": "sinks_heavy_recent"}, "budget"),
        ({"preset": "sinks_heavy_recent", "budget": 5}, "budget"),
        ({"preset": "pyramid", "budget": 50}, "preset"),
        ({"regions": CLASSIC, "budget": 50}, "budget"),
        ({}, "regions"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf_kvcache.CompositeCache(model.config, **kwargs)


def _kl(p_logits, q_logits):
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_fp8_regions_hold_fewer_bytes_and_stay_close_to_full_precision():
    model = build_model("llama")
    ids = random_ids(1, 40, seed=14)
    fp8 = {"keys": "fp8_e4m3", "values": "fp8_e4m3"}
    full = [{"role": "sinks", "tokens": 2}, {**W, "start": 0, "end": 10}, {"role": "heavy", "tokens": 10}]
    mixed = [
        {"role": "sinks", "tokens": 2},
        {**W, "start": 0, "end": 10, **fp8},
        {"role": "heavy", "tokens": 10, **fp8},
    ]
    keep_all_fp8 = [{**W, "start": 0, "end": 4, **fp8}, {"role": "rest", **fp8}]
    with torch.no_grad():
        full_cache, mixed_cache = (hf_kvcache.CompositeCache(model, regions=r) for r in (full, mixed))
        a, b = _stream(model, full_cache, ids, 8), _stream(model, mixed_cache, ids, 8)
        dense = _stream(model, DynamicCache(config=model.config), ids, 8)
        keep = _stream(model, hf_kvcache.CompositeCache(model, regions=keep_all_fp8), ids, 8)
        fp8_cache = _stream(model, hf_kvcache.QuantizedFP8Cache(model, key_smoothing=False), ids, 8)
    assert mixed_cache.nbytes() < 0.55 * full_cache.nbytes()
    torch.testing.assert_close(a[:, :8], b[:, :8])  # the prompt attends to itself in full precision
    assert 0 < _kl(a, b) < 0.1  # FP8 noise, plus heavy hitters chosen from slightly different scores
    # without eviction, FP8 regions cost what the FP8 cache costs (one extra rounding when a token changes region)
    assert 0 < _kl(dense, keep) < 1.5 * _kl(dense, fp8_cache) < 0.02
    with pytest.raises(ValueError, match="channel"):
        hf_kvcache.CompositeCache(
            model.config, regions=[{**W, "start": 0, "end": 8, "keys": {"format": "int4", "granularity": "channel"}}]
        )


def _keys_at(model, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's keys [H, n, D] of the sequence `tokens` [n] placed at the contiguous `positions` [n]: RoPE
    attention depends only on relative positions, so shifting the whole sequence changes no hidden state and each
    key is the model's own key rotated to its new position (the model's RoPE, no rotator of ours involved)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=tokens[None], position_ids=positions[None], **cache_kwargs(cache), use_cache=True)
    return [layer.keys[0] for layer in cache.layers]


def test_per_head_composite_places_each_heads_sinks_before_that_heads_oldest_token():
    """With heavy hitters each KV head keeps its own tokens, so each head's sinks move to just before the oldest
    token that head kept (not head 0's): checked after every decode step against keys the model computes itself."""
    model = build_model("llama")
    sinks, ids = 2, random_ids(2, 40, seed=21)
    cache = hf_kvcache.CompositeCache(model, regions=CLASSIC)
    heads_differed = 0
    with torch.no_grad():
        model(input_ids=ids[:, :10], **cache_kwargs(cache), use_cache=True)
        for i in range(10, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
            for layer_idx, layer in enumerate(cache.layers):
                assert layer.slot_valid.shape[1] == layer.heads == 2  # per-head metadata
                stored = layer.store.read(layer.used)[0][:, :, :sinks]  # [B, H, sinks, D]
                valid = layer.slot_valid[:, :, sinks : layer.used]
                positions = layer.head_positions()[:, :, sinks : layer.used].long()
                oldest = torch.where(valid, positions, 10**9).amin(-1)  # [B, H]
                heads_differed += int((oldest[:, 0] != oldest[:, 1]).sum())
                for row in range(ids.shape[0]):
                    for head in range(layer.heads):
                        target = oldest[row, head] - sinks + torch.arange(sinks)
                        want = _keys_at(model, ids[row, :sinks], target)[layer_idx][head]
                        torch.testing.assert_close(
                            stored[row, head],
                            want,
                            atol=1e-4,
                            rtol=1e-4,
                            msg=lambda m: f"step {i}, layer {layer_idx}, row {row}, head {head}: {m}",
                        )
    assert heads_differed > 0  # the heads really kept different oldest tokens (else this checks nothing per head)


# -- the decode fast path (issue 13) ------------------------------------------------------------------------------
def _kept(cache) -> list[list[list[list[int]]]]:
    """Per layer, row and meta head: the sorted stream indices of the valid non-sink slots."""
    out = []
    for layer in cache.layers:
        sinks = layer.policy.sinks
        valid, stream = layer.slot_valid[..., sinks:-1], layer.policy.stream[..., sinks:-1]
        out.append(
            [[sorted(stream[b, h][valid[b, h]].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])]
        )
    return out


@pytest.mark.parametrize("scorer", HEAVY_SCORERS)
@pytest.mark.parametrize("windows", [[(0, 4)], [(0, 2), (2, 5)]], ids=["one_window", "two_windows"])
def test_pooled_heavy_hitters_keep_the_tokens_of_the_region_by_region_layout(windows, scorer):
    """Heavy hitters at the last window's precision share its slots (no move between them); with that precision
    spelled differently ('full' vs the quantized store's exact 'none') the same regions keep a region of their own.
    Both hold exact values, so logits and kept tokens must agree step by step, with every heavy scorer."""
    model = build_model("llama")
    ids = random_ids(2, 45, seed=31)
    first = [{"role": "sinks", "tokens": 2}] + ([{**W, "start": 0, "end": windows[0][1]}] if len(windows) == 2 else [])
    last = {**W, "start": windows[-1][0], "end": windows[-1][1], "keys": "none", "values": "none"}
    heavy = {
        "role": "heavy",
        "tokens": 5,
        "scorer": scorer,
        **({"window": 2} if "window" in options_of(scorer) else {}),
    }
    pooled = hf_kvcache.CompositeCache(model, regions=first + [last, {**heavy, "keys": "none", "values": "none"}])
    separate = hf_kvcache.CompositeCache(model, regions=first + [last, heavy])
    with torch.no_grad():
        outs = []
        for cache in (pooled, separate):
            outs.append([model(input_ids=ids[:, :9], **cache_kwargs(cache), use_cache=True).logits])
        for i in range(9, ids.shape[1]):
            for cache, out in zip((pooled, separate), outs):
                out.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
            assert _kept(pooled) == _kept(separate), f"step {i}"
    assert len(pooled.layers[0].store.stores) == len(separate.layers[0].store.stores) - 1  # one pool
    assert pooled.layers[0].policy.pooled and not separate.layers[0].policy.pooled
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=1e-5, rtol=1e-5)


def test_preset_decode_moves_no_token_and_adjacent_windows_share_a_ring(monkeypatch):
    model = build_model("llama", num_hidden_layers=2)
    moves = []
    original = hf_kvcache.policies.composite.CompositePolicy._move
    monkeypatch.setattr(
        hf_kvcache.policies.composite.CompositePolicy,
        "_move",
        lambda self, *a, **k: moves.append(1) or original(self, *a, **k),
    )
    cache = hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=16)
    ids = random_ids(1, 40, seed=5)
    with torch.no_grad():
        model(input_ids=ids[:, :10], **cache_kwargs(cache), use_cache=True)
        moves.clear()
        for i in range(10, 40):
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
    assert moves == [] and [s.keys.shape[2] for s in cache.layers[0].store.stores] == [5, 13]  # + a trash slot each
    fp8 = {"keys": "fp8_e4m3", "values": "fp8_e4m3"}
    tiers = hf_kvcache.CompositeCache(
        model, regions=[{**W, "start": 0, "end": 3, **fp8}, {**W, "start": 3, "end": 8, **fp8}]
    )
    with torch.no_grad():
        model(input_ids=ids[:, :10], **cache_kwargs(tiers), use_cache=True)
    assert tiers.layers[0].policy.tier_sizes == (8,) and len(tiers.layers[0].store.stores) == 1


def _decode_ops(make) -> int:
    from hf_kvcache.evaluation.host_syncs import HostSyncCounter

    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    cache, ids = make(model), random_ids(1, 80, seed=9)
    with torch.no_grad():
        model(input_ids=ids[:, :70], **cache_kwargs(cache), use_cache=True)
        for i in range(70, 75):
            model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
        with HostSyncCounter() as counter:
            model(input_ids=ids[:, 75:76], **cache_kwargs(cache), use_cache=True)
    assert counter.syncs == 0
    return counter.ops


def test_preset_decode_work_does_not_depend_on_region_sizes():
    """The same aten operations per decode step at budgets 12 and 48 (no per-token loop, no move per region slot),
    and a bounded overhead over H2O at the same budget (the sinks' re-rotation, FP8 encode and decode; both share
    the attention bridge, so the difference is the cache's own work)."""
    small = _decode_ops(lambda m: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=12))
    large = _decode_ops(lambda m: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=48))
    h2o = _decode_ops(lambda m: hf_kvcache.H2OCache(m, budget=48))
    # per layer: 75 more than H2O (94 before the sinks were re-rotated in place, ~240 before the fast path)
    assert small == large and large - h2o <= 2 * 80, (small, large, h2o)


def test_moves_between_regions_of_one_format_copy_codes():
    """A token moving from an FP8 window to an FP8 'rest' keeps its codes (no dequantize + quantize, no second
    rounding): however long the window, every token holds the codes it got when it arrived, so the logits agree."""
    model = build_model("llama")
    ids = random_ids(2, 30, seed=17)
    fp8 = {"keys": "fp8_e4m3", "values": "fp8_e4m3"}
    logits = []
    for end in (1, 6):
        cache = hf_kvcache.CompositeCache(
            model, regions=[{**W, "start": 0, "end": end, **fp8}, {"role": "rest", **fp8}]
        )
        with torch.no_grad():
            logits.append(_stream(model, cache, ids, 8))
        assert len(cache.layers[0].store.stores) == 2
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


# -- the heavy region's scorer (issue 14) -------------------------------------------------------------------------
def _standalone(name):
    """The scorer cache of heavy scorer `name` holding what a composite of one window of `recent` tokens + heavy
    hitters ranked by it holds: SnapKV's observation window is the composite's window, and a scorer's sinks are 0
    (no sinks region in the composite)."""
    options = {"sinks": 0} if "sinks" in options_of(name) else {}

    def build(model, budget, recent):
        extra = {"window": recent} if "window" in options_of(name) else {}
        return hf_kvcache.CACHE_IMPLEMENTATIONS[name](model, budget=budget, recent=recent, **options, **extra)

    return build


# every heavy scorer of the registry but H2O's (its composite is tested against H2OCache above)
SCORER_CACHES = {name: _standalone(name) for name in HEAVY_SCORERS if name != "h2o"}


def _kept_positions(cache) -> list[list[list[list[int]]]]:
    """Per layer, row and KV head: the sorted position ids of the valid slots (trash slot excluded)."""
    return [
        [
            [
                sorted(layer.head_positions()[b, h, :-1][layer.slot_valid[b, h, :-1]].tolist())
                for h in range(layer.slot_valid.shape[1])
            ]
            for b in range(layer.slot_valid.shape[0])
        ]
        for layer in cache.layers
    ]


def _scored_composite(model, scorer, budget, recent, **kwargs):
    heavy = {"role": "heavy", "tokens": budget - recent, "scorer": scorer}
    if scorer in HEAVY_SCORERS and "window" in options_of(scorer):  # SnapKV's observation window: the window
        heavy["window"] = recent
    return hf_kvcache.CompositeCache(model, regions=[{**W, "start": 0, "end": recent}, heavy], **kwargs)


@pytest.mark.parametrize("scorer", sorted(SCORER_CACHES))
def test_heavy_scorer_keeps_the_tokens_of_the_standalone_scorer_cache(scorer):
    """A recent window + heavy hitters ranked by `scorer` = the scorer cache with the same budget and window: same
    logits and same kept tokens after a prefill in two chunks and at every decode step."""
    model = build_model("llama")
    ids = random_ids(2, 40, seed=5)
    composite, standalone = _scored_composite(model, scorer, 11, 3), SCORER_CACHES[scorer](model, 11, 3)
    with torch.no_grad():
        outs = []
        for cache in (composite, standalone):
            outs.append(
                [
                    model(input_ids=ids[:, :9], **cache_kwargs(cache), use_cache=True).logits,
                    model(input_ids=ids[:, 9:20], **cache_kwargs(cache), use_cache=True).logits,
                ]
            )
        assert _kept_positions(composite) == _kept_positions(standalone), "after the chunks"
        for i in range(20, ids.shape[1]):
            for cache, out in zip((composite, standalone), outs):
                out.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
            assert _kept_positions(composite) == _kept_positions(standalone), f"step {i}"
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scorer", sorted(SCORER_CACHES))
def test_heavy_scorer_with_left_padding_matches_the_standalone_cache(scorer):
    model = build_model("qwen2")
    ids, mask = left_pad([random_ids(1, 26, seed=6)[0], random_ids(1, 13, seed=7)[0]])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    composite, standalone = _scored_composite(model, scorer, 9, 2), SCORER_CACHES[scorer](model, 9, 2)
    with torch.no_grad():
        got = model.generate(ids, **cache_kwargs(composite), **kwargs)
        want = model.generate(ids, **cache_kwargs(standalone), **kwargs)
    assert got.tolist() == want.tolist()
    assert _kept_positions(composite) == _kept_positions(standalone)


def test_key_scorers_compute_no_attention_and_a_bad_scorer_names_the_field():
    model = build_model("llama", num_hidden_layers=1)
    for scorer, needs in (
        ("knorm", False),
        ("keydiff", False),
        ("tova", True),
        ("h2o", True),
        ("snapkv", True),
        ("expected_attention", False),
    ):
        policy = _scored_composite(model, scorer, 8, 2).layers[0].policy
        assert (policy.needs_attention, policy.deferred) == (needs, needs or scorer == "expected_attention"), scorer
    assert _scored_composite(model, "expected_attention", 8, 2).layers[0].policy.needs_queries
    with pytest.raises(ValueError, match=r"regions\[1\]\.scorer.*'h2o'.*'expected_attention'.*got 'pyramidkv'"):
        _scored_composite(model, "pyramidkv", 8, 2)


@pytest.mark.parametrize("scorer", sorted(SCORER_CACHES))
def test_heavy_scorer_decode_never_syncs(scorer):
    from test_host_syncs import _decode_syncs

    _, per_step = _decode_syncs(lambda m: _scored_composite(m, scorer, 8, 2), padded=True)
    assert all(syncs == 0 for syncs, _ in per_step), per_step


def test_expected_attention_with_a_sinks_region_keeps_the_tokens_of_the_standalone_cache():
    """kvpress's protocol: 4 sinks left out of the query statistics and never evicted. In the composite they are the
    sinks region (at their original positions), in ExpectedAttentionCache position ids below `sinks`."""
    model = build_model("llama")
    ids = random_ids(2, 40, seed=8)
    composite = hf_kvcache.CompositeCache(
        model,
        sink_positions="original",
        regions=[
            {"role": "sinks", "tokens": 4},
            {**W, "start": 0, "end": 3},
            {"role": "heavy", "tokens": 6, "scorer": "expected_attention"},
        ],
    )
    standalone = hf_kvcache.ExpectedAttentionCache(model, budget=13, recent=3, sinks=4)
    with torch.no_grad():
        outs = [
            [model(input_ids=ids[:, :20], **cache_kwargs(cache), use_cache=True).logits]
            for cache in (composite, standalone)
        ]
        for i in range(20, ids.shape[1]):
            for cache, out in zip((composite, standalone), outs):
                out.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
            assert _kept_positions(composite) == _kept_positions(standalone), f"step {i}"
    torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=2e-5, rtol=1e-5)


def test_snapkv_options_are_validated_naming_the_field():
    model = build_model("llama", num_hidden_layers=1)
    window = {**W, "start": 0, "end": 4}
    cases = [
        ({"scorer": "snapkv", "window": 5}, r"regions\[1\]\.window \(5\) must not exceed the window regions' span \(4"),
        ({"scorer": "snapkv", "kernel": 4}, r"regions\[1\]\.kernel` must be odd"),
        ({"scorer": "snapkv", "window": 0}, r"regions\[1\]\.window` must be an integer >= 1"),
        ({"scorer": "h2o", "kernel": 3}, r"regions\[1\]\.kernel is an option of scorer 'snapkv' only"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            hf_kvcache.CompositeCache(model, regions=[window, {"role": "heavy", "tokens": 4, **options}])


def test_preset_takes_a_heavy_scorer():
    model = build_model("llama", num_hidden_layers=1)
    cache = hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=140, scorer="snapkv")
    assert cache.regions[2] == {
        "role": "heavy",
        "tokens": 68,
        "keys": "fp8_e4m3",
        "values": "fp8_e4m3",
        "scorer": "snapkv",
    }
    assert cache.layers[0].policy.scorer.window == 64
    assert "scorer" not in hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=140).regions[2]
    with pytest.raises(ValueError, match=r"scorer 'snapkv' needs `budget` >= 132 .*got 100"):
        hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=100, scorer="snapkv")
    with pytest.raises(ValueError, match=r"`scorer` must be one of \('h2o', .*'expected_attention'.*\), got 'lru'"):
        hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=100, scorer="lru")
    with pytest.raises(ValueError, match=r"`scorer` is for presets; with `regions`, give it in the heavy region"):
        hf_kvcache.CompositeCache(model, regions=[{**W, "start": 0, "end": 4}], scorer="tova")
