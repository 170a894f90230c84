"""Memory accounting: fixed-budget caches stay flat, and nbytes() is the bytes of the tensors actually held."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from transformers import DynamicCache

from hf_kvcache import FullCache, SinkCache, SlidingWindowCache, cache_kwargs

WINDOW = 32


# Shared by all layers and not part of what a layer stores: the per-forward announcement (new-token padding and
# positions, [B, q]) and the RoPE inverse frequencies of the in-cache position mode.
NOT_LAYER_STATE = {"forward_info", "rotator"}


def held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from a cache layer's own attributes (store, slot metadata, policy state), deduplicated
    by storage, so that nothing the layer holds is left out of the comparison with nbytes()."""
    seen = set() if seen is None else seen
    found = []
    for name, value in vars(obj).items():
        if name in NOT_LAYER_STATE:
            continue
        if isinstance(value, torch.Tensor):
            key = value.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                found.append(value)
        elif type(value).__module__.startswith("hf_kvcache") and hasattr(value, "__dict__"):
            found += held_tensors(value, seen)
    return found


def feed(model, cache, ids, start=0, chunk=1):
    with torch.no_grad():
        for t in range(start, ids.shape[1], chunk):
            model(ids[:, t : t + chunk], **cache_kwargs(cache), use_cache=True)


CACHES = {
    "sink_cache": lambda m: SinkCache(m, sinks=4, window=WINDOW - 4),
    "sink_original": lambda m: SinkCache(m, sinks=4, window=WINDOW - 4, position_mode="original"),
    "sliding": lambda m: SlidingWindowCache(m, window=WINDOW),
}


@pytest.mark.parametrize("cache_name", list(CACHES))
def test_nbytes_flat_after_budget(cache_name):
    model = build_model("llama")
    ids = random_ids(2, 400, seed=1)
    cache = CACHES[cache_name](model)
    assert cache.nbytes() == 0  # nothing allocated before the first update
    sizes, shapes = {}, {}
    with torch.no_grad():
        model(ids[:, :10], **cache_kwargs(cache), use_cache=True)  # prefill shorter than the budget
        at_prefill = cache.nbytes()
        for t in range(10, 400):
            model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            if t + 1 in (WINDOW, 50, 200, 400):
                sizes[t + 1] = cache.nbytes()
                shapes[t + 1] = [tuple(layer.store.keys.shape) for layer in cache.layers]
    assert at_prefill > 0
    assert sizes[50] == sizes[200] == sizes[400] == sizes[WINDOW] == at_prefill
    assert shapes[50] == shapes[200] == shapes[400]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for shape in shapes[400]:
        # [batch, kv heads, budget + 1 trash slot, head_dim]
        assert shape == (2, cfg.num_key_value_heads, WINDOW + 1, head_dim)
    assert cache.get_seq_length() == 400


@pytest.mark.parametrize("cache_name", list(CACHES))
def test_nbytes_flat_after_long_prefill(cache_name):
    """A prompt much longer than the budget allocates only the budget."""
    model = build_model("llama")
    ids = random_ids(1, 300, seed=2)
    cache = CACHES[cache_name](model)
    feed(model, cache, ids[:, :40], chunk=40)
    small = cache.nbytes()
    cache2 = CACHES[cache_name](model)
    feed(model, cache2, ids, chunk=300)
    assert cache2.nbytes() == small
    feed(model, cache2, random_ids(1, 50, seed=3))
    assert cache2.nbytes() == small


@pytest.mark.parametrize("cache_name", [*CACHES, "full"])
def test_nbytes_equals_bytes_of_held_tensors(cache_name):
    model = build_model("llama")
    make = CACHES.get(cache_name, lambda m: FullCache(m))
    cache = make(model)
    ids = random_ids(3, 90, seed=4)
    feed(model, cache, ids[:, :20], chunk=20)
    feed(model, cache, ids, start=20)
    total = 0
    for layer in cache.layers:
        tensors = held_tensors(layer)
        metadata = [t for t in (layer.slot_pos, layer.slot_valid) if t is not None]
        names = {id(layer.store.keys), id(layer.store.values)} | {id(t) for t in metadata}
        assert names <= {id(t) for t in tensors}
        # after a decode step the columns given to attention are a view of slot_valid, not a separate allocation
        assert layer._attention_columns.untyped_storage().data_ptr() == layer.slot_valid.untyped_storage().data_ptr()
        expected = sum(t.nbytes for t in tensors)
        assert layer.nbytes() == expected, cache_name
        total += expected
    assert cache.nbytes() == total


def test_sink_policy_state_is_counted():
    model = build_model("llama")
    cache = SinkCache(model, sinks=4, window=8)
    feed(model, cache, random_ids(2, 30, seed=5))
    layer = cache.layers[0]
    store_and_slots = layer.store.nbytes() + layer.slot_pos.nbytes + layer.slot_valid.nbytes
    policy = layer.policy
    assert policy.sink_keys is not None  # in-cache mode keeps un-rotated copies of the sinks
    shift = policy.memory._shift  # the rotation's per-sink position offsets ([B, 1, sinks] long)
    assert shift is not None and shift.shape == (2, 1, 4)
    assert (
        layer.nbytes()
        == store_and_slots
        + policy.n_real.nbytes
        + policy.sink_keys.nbytes
        + policy.sink_pos.nbytes
        + policy.sink_index.nbytes
        + shift.nbytes
    )


def test_full_cache_grows_and_is_at_least_dynamic():
    """The keep-all reference grows with the stream; its buffers hold at least what DynamicCache holds."""
    model = build_model("llama")
    ids = random_ids(1, 120, seed=6)
    cache, dyn = FullCache(model), DynamicCache(config=model.config)
    feed(model, cache, ids[:, :40])
    feed(model, dyn, ids[:, :40])
    a = cache.nbytes()
    feed(model, cache, ids, start=40)
    feed(model, dyn, ids, start=40)
    b = cache.nbytes()
    assert b > a
    dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)
    assert b >= dyn_bytes
    # growth is by doubling: at most ~2x what is needed (+ trash slot + metadata)
    assert all(layer.slot_pos is None for layer in cache.layers)  # keep-all: slot i is token i, no positions kept
    assert b <= 2 * dyn_bytes + sum(layer.slot_valid.nbytes for layer in cache.layers) + 4 * sum(
        layer.store.keys[:, :, :1].nbytes for layer in cache.layers
    )


def test_fixed_caches_smaller_than_dynamic_for_long_streams():
    model = build_model("llama")
    ids = random_ids(1, 200, seed=7)
    dyn = DynamicCache(config=model.config)
    feed(model, dyn, ids, chunk=200)
    dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)
    for make in CACHES.values():
        cache = make(model)
        feed(model, cache, ids, chunk=200)
        assert cache.nbytes() < dyn_bytes / 4
