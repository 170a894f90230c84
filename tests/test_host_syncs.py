"""No host-device synchronisation in decode: counted on the CPU with hf_kvcache.evaluation.host_syncs.

A decode step of every cache, with and without left padding, must issue none of the operations that make an
accelerator wait for the host (`.item()`, `bool(t)`, `.tolist()`, `nonzero`, boolean-mask indexing ...). Prefill may
read the padding mask on the host a bounded number of times per forward, never once per layer."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_pad, random_ids

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.evaluation.host_syncs import HostSyncCounter

CACHES = {
    "sink": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6),
    "sink_original": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6, position_mode="original"),
    "sliding": lambda m: hf_kvcache.SlidingWindowCache(m, window=8),
    "h2o": lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4),
    "h2o_compact": lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4, position_mode="compact"),
    "random_eviction": lambda m: hf_kvcache.RandomEvictionCache(m, heavy=4, recent=4),
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
    "fp8_residual": lambda m: hf_kvcache.QuantizedFP8Cache(m, residual=4, granularity="head"),
    "kivi": lambda m: hf_kvcache.KIVICache(m, residual=8, group_size=8),
    "kivi_max_length": lambda m: hf_kvcache.KIVICache(m, residual=3, group_size=4, max_length=32),
}
LAYERS = 3


def test_decode_under_inference_mode_never_syncs():
    with torch.inference_mode():  # .item() / bool() reach the counter as other aten ops here
        _, per_step = _decode_syncs(CACHES["composite"], padded=True)
    assert all(syncs == 0 for syncs, _ in per_step), per_step


def _decode_syncs(make, padded: bool, steps: int = 12):
    """(syncs of the prefill forward, [syncs per decode step]) for a fresh cache on a tiny Llama."""
    model = build_model("llama", num_hidden_layers=LAYERS)
    hf_kvcache.enable(model)
    ids = random_ids(2, 10)
    if padded:
        ids, mask = left_pad([ids[0], ids[1, 3:]])
    else:
        mask = torch.ones_like(ids)
    cache = make(model)
    per_step = []
    with torch.no_grad(), HostSyncCounter() as prefill:
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
    for _ in range(steps):  # long enough for every cache to fill and evict
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
        positions = (mask.cumsum(-1) - 1)[:, -1:]
        with torch.no_grad(), HostSyncCounter() as counter:
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
        per_step.append((counter.syncs, dict(counter.by_name)))
    assert torch.isfinite(out.logits).all()
    return prefill, per_step


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("name", sorted(CACHES))
def test_decode_steps_never_sync(name, padded):
    prefill, per_step = _decode_syncs(CACHES[name], padded)
    assert all(syncs == 0 for syncs, _ in per_step), per_step
    # prefill: a bounded number per forward (the padding mask read once, transformers' own mask checks), not one
    # per layer: the same with 3 layers as the per-forward checks alone allow
    assert prefill.syncs <= 6, dict(prefill.by_name)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_counter_sees_what_would_sync(context):
    with context():
        x = torch.arange(6)
        _count_syncs(x, context)


def _count_syncs(x, context):
    with HostSyncCounter() as counter:
        x.tolist()
        bool(x[0])
        x.nonzero()
        x[x > 2]
        torch._assert_async(torch.tensor(True))  # checked on the device: not a sync
    assert counter.syncs == 4, dict(counter.by_name)
    scalar = {"aten._local_scalar_dense"} if context is torch.no_grad else {"aten.is_nonzero"}
    assert set(counter.by_name) == {"Tensor.tolist", "aten.nonzero", "aten.index (boolean mask)"} | scalar


def test_non_finite_decode_write_still_refused_without_a_sync():
    model = build_model("llama", num_hidden_layers=1)
    cache = hf_kvcache.QuantizedFP8Cache(model)
    layer = cache.layers[0]
    ids = random_ids(1, 6)
    model(input_ids=ids, **cache_kwargs(cache))
    before = layer.store.length
    bad = torch.full((1, layer.heads, 1, layer.head_dim), float("nan"))
    with pytest.raises(hf_kvcache.stores.NonFiniteError, match="non-finite"):
        layer.store.write_slot(before, bad, bad)
    assert layer.store.length == before  # unchanged
