"""Head-adaptive budgets (AdaKV, hf_kvcache.policies.head_budgets): one slot pool of `budget x kv_heads` per layer
(hf_kvcache.stores.head_pool), allotted to the heads by score, in both compression modes."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, build_model, left_pad, random_ids

from hf_kvcache import CACHE_IMPLEMENTATIONS, cache_kwargs
from hf_kvcache.policies.head_budgets import adaptive_keep, pool_destinations, pool_victims

SCORERS = ("h2o", "knorm", "keydiff", "snapkv", "expected_attention")  # (TOVA keeps one token set per layer)
BUDGET = 8


def _cache(model, name, **config):
    extra = {"window": 2} if name == "snapkv" else {"future": 16} if name == "expected_attention" else {}
    return CACHE_IMPLEMENTATIONS[name](model, budget=BUDGET, **extra, **config)


def _logits(model, cache, ids, prompt):
    with torch.no_grad():
        out = [model(input_ids=ids[:, :prompt], **cache_kwargs(cache)).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            out.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
    return torch.stack(out, 1)


def _kept(cache):
    layer = cache.layers[0]
    valid, pos = layer.slot_valid[..., :-1], layer.head_positions()[..., :-1]
    return [[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])]


@pytest.mark.parametrize("compress", ["prompt", "always"])
@pytest.mark.parametrize("name", SCORERS)
def test_a_safeguard_of_the_whole_budget_is_the_uniform_budget(name, compress):
    """safeguard 1.0: every head keeps its own top `budget` (AdaKV's floor is the budget), so the pooled layer must
    keep the uniform cache's tokens and give its logits: the pool's storage, reads and masks are exact."""
    model = build_model("llama")
    ids = random_ids(2, 30, seed=11)
    uniform = _cache(model, name, compress=compress)
    pooled = _cache(model, name, compress=compress, head_budget="adaptive", safeguard=1.0)
    want, got = _logits(model, uniform, ids, 20), _logits(model, pooled, ids, 20)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert _kept(pooled) == _kept(uniform)
    assert pooled.layers[0].store.keys.shape[1] == 1  # one pool, not a buffer per head
    assert pooled.layers[0].slot_pos.shape[1] == 1  # one position per pool slot (each slot is one head's)


@pytest.mark.parametrize("compress", ["prompt", "always"])
@pytest.mark.parametrize("name", SCORERS)
def test_the_layer_holds_its_budget_ragged_over_heads(name, compress):
    model = build_model("llama")
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    cache = _cache(model, name, compress=compress, head_budget="adaptive")
    ids = random_ids(2, 26, seed=12)
    _logits(model, cache, ids, 20)
    layer = cache.layers[0]
    counts = layer.slot_valid[..., : layer.used].sum(-1)  # [B, H]
    appended = 6 if compress == "prompt" else 0
    assert counts.sum(-1).tolist() == [(BUDGET + appended) * heads] * 2  # the layer's total, however split
    assert (counts >= int(BUDGET * 0.2) + appended).all()  # AdaKV's floor per head
    if compress == "always":  # the pool's bytes are the budget (+ the trash slot), whatever the split
        itemsize = layer.store.keys.element_size()
        assert layer.store.nbytes() == 2 * (BUDGET * heads + 1) * 2 * head_dim * itemsize
        assert layer.store.nbytes() == cache.layers[0].store.keys.nbytes * 2
        assert layer.slot_pos.nbytes == 2 * (BUDGET * heads + 1) * 4  # int32 per slot, not per head per slot


def test_adaptive_budgets_do_differ_across_heads():
    model = build_model("llama")
    cache = _cache(model, "expected_attention", compress="prompt", head_budget="adaptive")
    _logits(model, cache, random_ids(1, 40, seed=13), 40)
    counts = [layer.slot_valid[..., : layer.used].sum(-1) for layer in cache.layers]
    assert any(len(set(c[0].tolist())) > 1 for c in counts)


def test_left_padded_rows_generate_as_alone():
    model = build_model("llama")
    rows = [random_ids(1, n, seed=50 + n)[0] for n in (12, 19, 15)]
    ids, mask = left_pad(rows)
    kwargs = dict(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=PAD,
        cache_implementation="expected_attention",
        cache_config={"budget": BUDGET, "future": 16, "head_budget": "adaptive"},
    )
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), f"row {i}"


def test_selection_functions():
    inf = float("inf")
    score = torch.tensor([[[5.0, 4.0, 3.0, -inf], [0.1, 0.2, inf, 0.3]]])
    kept = adaptive_keep(score, total=4, floor=1)
    # head 1 keeps its best (inf) and its floor is that one; the rest go to the best over both heads: 5, 4, 3
    assert kept.tolist() == [[[True, True, True, False], [False, False, True, False]]]
    assert adaptive_keep(score, total=4, floor=2).tolist() == [[[True, True, False, False], [False, False, True, True]]]
    held = torch.tensor([[True, False, True, False, False]])
    dest = pool_destinations(torch.tensor([[[True, False], [True, True]]]), held)
    assert dest.tolist() == [[[1, -1], [3, 4]]]
    valid = torch.tensor([[[True, True, False, False], [False, False, True, False]]])
    key = torch.tensor([[[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0]]])
    assert sorted(pool_victims(key, valid, floor=1)[0].tolist()) == [2, 3]  # the empty slot, then the lowest (0.5)
    assert sorted(pool_victims(key, valid, floor=2)[0].tolist()) == [0, 3]  # head 1 would fall below its floor
    filling = torch.tensor([[[True, False, False, False, False, False], [False, True, False, False, False, False]]])
    assert pool_victims(torch.zeros(1, 2, 6), filling, floor=0)[0].tolist() == [2, 3]  # the lowest empty slots


def test_bad_settings_name_the_field():
    model = build_model("llama")
    with pytest.raises(ValueError, match="head_budget.*adaptive"):
        _cache(model, "knorm", head_budget="per_head")
    with pytest.raises(ValueError, match="safeguard"):
        _cache(model, "knorm", head_budget="adaptive", safeguard=1.5)


def test_compact_positions_refuse_the_pool():
    with pytest.raises(ValueError, match="position_mode"):
        CACHE_IMPLEMENTATIONS["h2o"](build_model("llama"), budget=8, position_mode="compact", head_budget="adaptive")
