"""KVzapCache (hf_kvcache.caches.kvzap): KVzip's placement by a surrogate's predicted scores, on tiny models with a
planted linear surrogate, and with the surrogate shipped for SmolLM2 (the offline model)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_pad, offline_model, random_ids
from conftest import planted_surrogate as planted

import hf_kvcache
from hf_kvcache import KVzapCache, cache_kwargs
from hf_kvcache.integration.attention_inputs import capture_attention_inputs
from hf_kvcache.scorers.kvzap_surrogate import Surrogate

UNIFORM = {"head_budget": "uniform", "layer_budget": "uniform", "recent": 0}


def predicted(model, surrogate: Surrogate, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The surrogate's scores [B, Hkv, n] per layer from a plain forward's attention inputs."""
    seen = {}
    with capture_attention_inputs(model, lambda i, h: seen.setdefault(i, surrogate.predict(i, h))), torch.no_grad():
        model(ids)
    return seen


def kept_positions(layer) -> list:
    used = layer.used
    valid, positions = layer.slot_valid[..., :used], layer.head_positions()[..., :used]
    return [
        [sorted(positions[b, h][valid[b, h]].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])
    ]


def test_uniform_budget_keeps_each_heads_top_predicted_tokens():
    model = build_model("llama")
    surrogate = planted(model)
    ids = random_ids(2, 30, seed=3)
    scores = predicted(model, surrogate, ids)
    cache = KVzapCache(model, budget=8, surrogate=surrogate, sinks=2, **UNIFORM)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        cache.compress_context(model)
    for layer in cache.layers:
        ranked = scores[layer.layer_idx].clone()
        ranked[..., :2] = float("inf")  # the sinks
        want = [[sorted(row.topk(8).indices.tolist()) for row in heads] for heads in ranked]
        assert kept_positions(layer) == want


def test_default_allots_the_models_budget_by_prediction_and_runs_no_extra_forward():
    model = build_model("llama")
    surrogate = planted(model, seed=1)
    defaults = KVzapCache(model, budget=8, surrogate=surrogate)
    assert (defaults.head_budget, defaults.layer_budget, defaults.compress) == ("adaptive", "adaptive", "prompt")
    assert defaults.recent == 2  # a quarter of a token budget below 256
    assert KVzapCache(model, budget=1000, surrogate=surrogate).recent == 64
    assert KVzapCache(model, budget=12, surrogate=surrogate, compress="always").recent == 4  # a third in "always"
    cache = KVzapCache(model, budget=8, surrogate=surrogate, recent=0)
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model(random_ids(1, 30, seed=5), **cache_kwargs(cache))
        cache.compress_context(model)
    handle.remove()
    assert len(calls) == 1  # the prefill only: no reconstruction forwards
    heads = model.config.num_key_value_heads
    kept = [int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers]
    assert sum(kept) == 8 * heads * len(cache.layers)
    assert len(set(kept)) > 1  # the layers' shares follow the predictions


def test_generate_by_name_with_a_saved_surrogate(tmp_path):
    model = build_model("llama")
    planted(model, seed=2).save(tmp_path / "surrogate")
    ids = random_ids(1, 24, seed=4)
    config = {"budget": 8, "surrogate": str(tmp_path / "surrogate")}
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="kvzap", cache_config=config)
    cache = KVzapCache(model, **config)
    again = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(cache))
    assert out.tolist() == again.tolist()
    full = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert cache.get_seq_length() == 24 + 5
    assert out.shape == full.shape


def test_always_mode_scores_decode_tokens_and_holds_the_placed_share():
    model = build_model("llama")
    surrogate = planted(model, seed=3)
    cache = KVzapCache(model, budget=8, surrogate=surrogate, compress="always", recent=2)
    ids = random_ids(1, 24, seed=6)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        cache.compress_context(model)
        held = [int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers]
        step = ids[:, -1:]
        for _ in range(12):
            logits = model(step, **cache_kwargs(cache)).logits
            step = logits[:, -1:].argmax(-1)
    after = [int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers]
    assert after == held  # evicting: each layer keeps its share of the model's budget
    newest = [
        int(layer.head_positions()[..., : layer.used].masked_fill(~layer.slot_valid[..., : layer.used], -1).max())
        for layer in cache.layers
    ]
    assert newest == [24 + 11] * len(cache.layers)  # the newest token is kept (recent window)
    prompt_mode = KVzapCache(model, budget=8, surrogate=surrogate)
    with torch.no_grad():
        model(ids, **cache_kwargs(prompt_mode))
        for _ in range(12):
            model(ids[:, -1:], **cache_kwargs(prompt_mode))
    assert sum(int(layer.slot_valid.sum()) for layer in prompt_mode.layers) > sum(after)  # prompt mode appends
    by_ratio = KVzapCache(model, budget=0.5, surrogate=surrogate, compress="always")
    with torch.no_grad():
        model(ids, **cache_kwargs(by_ratio))
        by_ratio.compress_context(model)
    assert by_ratio.recent == 4  # the default window once the prompt is known: a third of 12 tokens


def test_the_recent_window_is_part_of_the_budget():
    model = build_model("llama")
    cache = KVzapCache(model, budget=8, surrogate=planted(model, seed=5), recent=3)
    with torch.no_grad():
        model(random_ids(1, 30, seed=7), **cache_kwargs(cache))
        cache.compress_context(model)
    heads = model.config.num_key_value_heads
    assert sum(int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers) == 8 * heads * len(
        cache.layers
    )
    for layer in cache.layers:
        for head in kept_positions(layer)[0]:
            assert {27, 28, 29} <= set(head)  # every head keeps the window
    with pytest.raises(ValueError, match="recent"):
        KVzapCache(model, budget=8, surrogate=planted(model), recent=9)


def test_left_padded_rows_keep_what_they_keep_alone():
    model = build_model("llama")
    surrogate = planted(model, seed=4)
    rows = [random_ids(1, 22, seed=1)[0], random_ids(1, 15, seed=2)[0]]
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # (as generate gives them: each row's first real token at 0)
    batch = KVzapCache(model, budget=6, surrogate=surrogate, **UNIFORM)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(batch))
        batch.compress_context(model)
    for b, row in enumerate(rows):
        alone = KVzapCache(model, budget=6, surrogate=surrogate, **UNIFORM)
        with torch.no_grad():
            model(row[None], **cache_kwargs(alone))
            alone.compress_context(model)
        for lb, la in zip(batch.layers, alone.layers):
            assert kept_positions(lb)[b] == kept_positions(la)[0]


def test_bad_surrogates_are_refused_naming_the_parameter(tmp_path):
    model = build_model("llama")
    with pytest.raises(ValueError, match="surrogate"):
        KVzapCache(model, budget=8)  # a tiny model has no shipped surrogate
    with pytest.raises(ValueError, match="surrogate"):
        KVzapCache(model, budget=8, surrogate=3)
    other = build_model("llama", hidden_size=model.config.hidden_size * 2)
    with pytest.raises(ValueError, match="hidden_size"):
        KVzapCache(model, budget=8, surrogate=planted(other))
    with pytest.raises(ValueError, match="compress"):
        KVzapCache(model, budget=8, surrogate=planted(model), compress="sometimes")


def test_shipped_surrogate_fits_smollm2():
    model, _ = offline_model("smollm2")
    cache = KVzapCache(model, budget=0.2)  # the shipped surrogate, found by the model
    assert cache.surrogate.kv_heads == model.config.num_key_value_heads
    assert hf_kvcache.CACHE_IMPLEMENTATIONS["kvzap"] is KVzapCache
