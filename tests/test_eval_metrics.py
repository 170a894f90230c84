"""Harness metrics on tiny models: perplexity and divergence against direct computations, cache specs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build_model, random_ids
from transformers import DynamicCache

from hf_kvcache import FullCache, SinkCache, cache_kwargs
from hf_kvcache.evaluation.cache_spec import (
    CacheSpec,
    available_caches,
    check_cache,
    make_cache,
    make_factory,
    resolve_config,
)
from hf_kvcache.evaluation.divergence import cache_logprobs, divergence, divergence_metrics, full_sequence_logprobs
from hf_kvcache.evaluation.perplexity import chunked_nll, run_perplexity

N, P = 64, 40


@pytest.fixture(scope="module")
def tiny():
    return build_model("llama", seed=3)


@pytest.fixture(scope="module")
def ids():
    return random_ids(1, N, seed=11)


def direct_nlls(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    return (torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(-1, ids[0, 1:, None])[:, 0]).numpy()


# -- perplexity ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stream", "chunked"])
@pytest.mark.parametrize("cache", ["dynamic", "hf_kvcache_full"])
def test_perplexity_equals_direct_with_full_cache(tiny, ids, mode, cache):
    factory = make_factory(tiny, CacheSpec(cache))
    result = run_perplexity(tiny, ids, factory, mode=mode, chunk=7, bucket=20)
    ref = direct_nlls(tiny, ids)
    np.testing.assert_allclose(result["nlls"], ref, atol=1e-4, rtol=0)
    assert result["ppl"] == pytest.approx(math.exp(ref.mean()), rel=1e-4)
    assert [b["tokens"] for b in result["buckets"]] == [20, 20, 20, 3]
    assert mode in result["protocol"]


def test_chunked_differs_from_stream_only_by_its_stated_approximation(tiny, ids):
    """With an evicting cache, chunk=1 is the stream protocol exactly; larger chunks see more than the budget."""
    factory = lambda: SinkCache(tiny, sinks=2, window=10)
    stream = run_perplexity(tiny, ids, factory, mode="stream")["nlls"]
    np.testing.assert_allclose(chunked_nll(tiny, ids, factory, chunk=1), stream, atol=1e-5, rtol=0)
    chunked = chunked_nll(tiny, ids, factory, chunk=16)
    assert np.abs(chunked - stream).max() > 1e-3
    # the first 12 tokens (before any eviction) are the same in both modes
    np.testing.assert_allclose(chunked[:11], stream[:11], atol=1e-4, rtol=0)


# -- divergence ------------------------------------------------------------------------------------------------------
def test_cache_logprobs_equal_full_sequence(tiny, ids):
    ref = full_sequence_logprobs(tiny, ids, P)
    assert ref.shape == (N - P, tiny.config.vocab_size)
    for cache in (DynamicCache(config=tiny.config), FullCache(tiny)):
        got = cache_logprobs(tiny, ids, cache, P)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    chunked_prefill = cache_logprobs(tiny, ids, DynamicCache(config=tiny.config), P, prefill_chunk=9)
    torch.testing.assert_close(chunked_prefill, ref, atol=1e-4, rtol=0)


def test_kl_zero_against_itself_and_matches_direct(tiny, ids):
    ref = full_sequence_logprobs(tiny, ids, P)
    same = divergence_metrics(ref, ref, ids[0, P:])
    assert same["kl_mean"] == 0.0 and same["kl_max"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["top5_agreement"] == 1.0
    # the full cache through the harness: KL ~ 0, perplexity equal to the direct one
    m = divergence(tiny, ids, lambda: FullCache(tiny), P, reference=ref)
    assert m["kl_max"] < 1e-6 and m["top1_agreement"] == 1.0
    direct = direct_nlls(tiny, ids)[P - 1 :]
    assert m["ppl"] == pytest.approx(math.exp(direct.mean()), rel=1e-5)
    assert m["ppl_ref"] == pytest.approx(math.exp(direct.mean()), rel=1e-5)


def test_kl_by_hand():
    """KL, top-1 and top-k against an explicit computation on small distributions."""
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(50, 12, generator=g), -1)
    b = torch.log_softmax(torch.randn(50, 12, generator=g), -1)
    m = divergence_metrics(a, b, k=3, return_per_position=True)
    pa = a.double().exp()
    kl = (pa * (a.double() - b.double())).sum(-1).numpy()
    np.testing.assert_allclose(m["kl"], kl, rtol=1e-12)
    assert m["kl_mean"] == pytest.approx(kl.mean()) and m["kl_p99"] == pytest.approx(np.percentile(kl, 99))
    assert m["top1_agreement"] == pytest.approx((a.argmax(-1) == b.argmax(-1)).double().mean().item())
    ta, tb = a.topk(3).indices.tolist(), b.topk(3).indices.tolist()
    assert m["top3_agreement"] == pytest.approx(np.mean([len(set(x) & set(y)) / 3 for x, y in zip(ta, tb)]))


class NoisyCache(DynamicCache):
    """A perturbed full cache: Gaussian noise on every stored key."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        g = torch.Generator().manual_seed(layer_idx)
        key_states = key_states + 0.3 * torch.randn(key_states.shape, generator=g)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_kl_positive_for_perturbed_caches(tiny, ids):
    ref = full_sequence_logprobs(tiny, ids, P)
    noisy = divergence(tiny, ids, lambda: NoisyCache(config=tiny.config), P, reference=ref)
    evicting = divergence(tiny, ids, lambda: SinkCache(tiny, sinks=2, window=8), P, reference=ref)
    for m in (noisy, evicting):
        assert m["kl_mean"] > 1e-3 and m["kl_p99"] >= m["kl_mean"]
        assert m["top1_agreement"] < 1.0


# -- cache specs -----------------------------------------------------------------------------------------------------
def test_resolve_budget_fractions():
    assert resolve_config("sink", {"sinks": 4, "budget": 0.25}, 1000) == {"sinks": 4, "budget": 250}
    assert resolve_config("sliding", {"window": "10%"}, 512) == {"window": 51}
    assert resolve_config("sliding", {"window": 300}, 100) == {"window": 300}
    assert resolve_config("sliding", {"window": 0.0001}, 100) == {"window": 1}


@pytest.mark.parametrize(
    "name, config, match",
    [
        ("sinc", {}, r"unknown cache 'sinc'; valid names are hf_kvcache caches \[.*'sink'"),
        ("sink", {"windows": 3}, r"unknown key\(s\) \['windows'\] for cache 'sink'"),
        ("sliding", {"window": 1.5}, r"cache\.window: a budget fraction must be in \(0, 1\]"),
        ("sliding", {"window": 0}, r"cache\.window: a budget is a number of tokens"),
        ("sliding", {"window": "lots"}, r"cache\.window: a budget is"),
        ("sink", {"sinks": 8, "budget": 8}, r"invalid config .* `sinks` \(8\) must be smaller than `budget`"),
        ("quantized", {"backend": "int3"}, r"cache\.backend: must be one of"),
        ("dynamic", {"window": 4}, r"unknown key\(s\) \['window'\] for cache 'dynamic'; valid keys are \[\]"),
    ],
)
def test_check_cache_errors(name, config, match):
    with pytest.raises(ValueError, match=match):
        check_cache(name, config, context_len=100, where="cache")


def test_fraction_needs_context():
    with pytest.raises(ValueError, match="needs a context length"):
        check_cache("sliding", {"window": 0.5})


def test_every_registered_cache_is_available_and_builds(tiny):
    """New caches registered in CACHE_IMPLEMENTATIONS are picked up without changes to the harness."""
    from hf_kvcache import CACHE_IMPLEMENTATIONS

    names = available_caches()
    assert names["hf_kvcache"] == sorted([*CACHE_IMPLEMENTATIONS, "hf_kvcache_full"])
    assert {"dynamic", "quantized", "static"} <= set(names["transformers"])
    ids = random_ids(1, 12, seed=1)
    for name in ["dynamic", "static", "sink", "sliding"]:
        config = {"sink": {"budget": 0.5}, "sliding": {"window": 0.5}}.get(name, {})
        cache = make_cache(tiny, name, config, context_len=12, total_len=16)
        with torch.no_grad():
            tiny(ids, **cache_kwargs(cache), use_cache=True)
        assert cache.get_seq_length() == 12


def test_quantized_fp8_builtin(tiny, ids):
    ref = full_sequence_logprobs(tiny, ids, P)
    m = divergence(tiny, ids, make_factory(tiny, CacheSpec("quantized", {"backend": "fp8"})), P, reference=ref)
    assert 0 < m["kl_mean"] < 0.5
