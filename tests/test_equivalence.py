"""With a budget at least the stream length, every hf_kvcache cache must behave exactly like DynamicCache."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCH_NAMES, build_model, left_pad, random_ids
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import FullCache, SinkCache, SlidingWindowCache, cache_kwargs

PREFILL, TOTAL = 7, 20

CACHES = {
    "sink_cache": lambda m: SinkCache(m, sinks=4, window=TOTAL),
    "sink_original": lambda m: SinkCache(m, sinks=4, window=TOTAL, position_mode="original"),
    "sink_exact_budget": lambda m: SinkCache(m, sinks=3, budget=TOTAL),
    "sliding": lambda m: SlidingWindowCache(m, window=TOTAL),
    "full": lambda m: FullCache(m),
}


def stream(model, cache, ids, prefill=PREFILL, attention_mask=None):
    """Logits [B, T, V] for a prefill then one-token decode steps, passing the growing mask and positions."""
    out = []
    with torch.no_grad():
        if attention_mask is None:
            out.append(model(ids[:, :prefill], **cache_kwargs(cache), use_cache=True).logits)
            for t in range(prefill, ids.shape[1]):
                out.append(model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits)
        else:
            pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            out.append(
                model(
                    ids[:, :prefill],
                    attention_mask=attention_mask[:, :prefill],
                    position_ids=pos[:, :prefill],
                    **cache_kwargs(cache),
                    use_cache=True,
                ).logits
            )
            for t in range(prefill, ids.shape[1]):
                out.append(
                    model(
                        ids[:, t : t + 1],
                        attention_mask=attention_mask[:, : t + 1],
                        position_ids=pos[:, t : t + 1],
                        **cache_kwargs(cache),
                        use_cache=True,
                    ).logits
                )
    return torch.cat(out, 1)


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_logits_equal_dynamic_cache(arch, cache_name):
    model = build_model(arch)
    ids = random_ids(2, TOTAL, seed=11)
    ref = stream(model, DynamicCache(config=model.config), ids)
    cache = CACHES[cache_name](model)
    got = stream(model, cache, ids)
    assert got.shape == ref.shape == (2, TOTAL, model.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == TOTAL


@pytest.mark.parametrize("cache_name", list(CACHES))
def test_logits_equal_dynamic_cache_eager(cache_name):
    model = build_model("llama", attn="eager")
    ids = random_ids(2, TOTAL, seed=12)
    ref = stream(model, DynamicCache(config=model.config), ids)
    got = stream(model, CACHES[cache_name](model), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("cache_name", list(CACHES))
def test_logits_equal_dynamic_cache_left_padded(cache_name, attn):
    """Left-padded batch fed directly to the model (mask and positions given): real positions match DynamicCache."""
    model = build_model("llama", attn=attn)
    rows = [random_ids(1, n, seed=20 + n)[0] for n in (TOTAL, TOTAL - 5, TOTAL - 9)]
    ids, mask = left_pad(rows)
    ref = stream(model, DynamicCache(config=model.config), ids, prefill=12, attention_mask=mask)
    got = stream(model, CACHES[cache_name](model), ids, prefill=12, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_dynamic_cache():
    """Several multi-token forwards (chunks) before decoding: the multi-token path with a non-empty past."""
    model = build_model("llama")
    ids = random_ids(1, TOTAL, seed=13)

    def chunks(cache):
        out = []
        with torch.no_grad():
            for a, b in ((0, 5), (5, 9), (9, 16), (16, 17), (17, 20)):
                out.append(model(ids[:, a:b], **cache_kwargs(cache), use_cache=True).logits)
        return torch.cat(out, 1)

    ref = chunks(DynamicCache(config=model.config))
    for make in CACHES.values():
        torch.testing.assert_close(chunks(make(model)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_generate_cache_implementation_matches_default(arch):
    model = build_model(arch)
    ids = random_ids(2, 9, seed=14)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    ref = model.generate(ids, **kwargs)
    assert ref.shape == (2, 21)
    sink = model.generate(ids, cache_implementation="sink", cache_config={"sinks": 4, "window": 32}, **kwargs)
    sink_orig = model.generate(
        ids, cache_implementation="sink", cache_config={"budget": 32, "position_mode": "original"}, **kwargs
    )
    sliding = model.generate(ids, cache_implementation="sliding", cache_config={"window": 21}, **kwargs)
    full = model.generate(ids, **cache_kwargs(FullCache(model.config)), **kwargs)
    for out in (sink, sink_orig, sliding, full):
        assert torch.equal(out, ref)


def test_generate_with_cache_object_built_from_config():
    """A cache built from a config (bridge not yet enabled) passed to generate: generate enables the bridge."""
    model = build_model("qwen2")
    ids = random_ids(1, 8, seed=15)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    cache = SinkCache(model.config, sinks=2, window=30)
    out = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == 8 + 10 - 1  # the last generated token is never fed back


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_bridge_is_transparent_for_dynamic_cache(arch, attn):
    model = build_model(arch, attn=attn)
    ids = random_ids(2, TOTAL, seed=16)
    rows = [random_ids(1, n, seed=40 + n)[0] for n in (TOTAL, TOTAL - 6)]
    pids, pmask = left_pad(rows)
    before = stream(model, DynamicCache(config=model.config), ids)
    before_padded = stream(model, DynamicCache(config=model.config), pids, prefill=10, attention_mask=pmask)
    before_gen = model.generate(pids, attention_mask=pmask, max_new_tokens=8, do_sample=False)

    assert hf_kvcache.enable(model) is model
    assert model.config._attn_implementation == f"hf_kvcache_{attn}"
    hf_kvcache.enable(model)  # idempotent

    after = stream(model, DynamicCache(config=model.config), ids)
    after_padded = stream(model, DynamicCache(config=model.config), pids, prefill=10, attention_mask=pmask)
    after_gen = model.generate(pids, attention_mask=pmask, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    real = pmask.bool()
    torch.testing.assert_close(after_padded[real], before_padded[real], atol=1e-6, rtol=0)
    assert torch.equal(after_gen, before_gen)


def test_bridge_transparent_after_our_cache_was_used():
    """Using one of our caches leaves no state that changes a later DynamicCache run on the same model."""
    model = build_model("llama")
    ids = random_ids(1, TOTAL, seed=17)
    before = stream(model, DynamicCache(config=model.config), ids)
    stream(model, SinkCache(model, sinks=2, window=5), ids)  # evicting run
    after = stream(model, DynamicCache(config=model.config), ids)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


# Regression (found by this suite, fixed in the library): attention.enable drops the bridge for good once disabled:
# disable() leaves model._hf_kvcache_enabled True, so enable() (and SinkCache(model), generate) return early with the
# plain attention function, and our validity masks are silently not applied
def test_enable_after_disable_restores_bridge():
    from hf_kvcache.attention.bridge import disable

    model = build_model("llama")
    rows = [random_ids(1, n, seed=50 + n)[0] for n in (14, 5)]
    ids, mask = left_pad(rows)
    kw = dict(
        max_new_tokens=12,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        cache_implementation="sink",
        cache_config={"sinks": 2, "window": 6},
    )
    alone = model.generate(rows[1][None], **kw).scores
    hf_kvcache.enable(model)
    disable(model)
    assert model.config._attn_implementation == "sdpa"
    hf_kvcache.enable(model)
    assert model.config._attn_implementation == "hf_kvcache_sdpa"
    batched = model.generate(ids, attention_mask=mask, **kw).scores
    for a, b in zip(batched, alone):
        torch.testing.assert_close(a[1], b[0], atol=1e-4, rtol=1e-4)


def test_bridge_transparent_and_exact_for_gpt_neox_sdpa():
    """A RoPE model with partial rotary and its own attention module, through the sdpa bridge."""
    model = build_model("gpt_neox")
    ids = random_ids(2, TOTAL, seed=18)
    ref = stream(model, DynamicCache(config=model.config), ids)
    for make in CACHES.values():
        torch.testing.assert_close(stream(model, make(model), ids), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stream(model, DynamicCache(config=model.config), ids), ref, atol=1e-6, rtol=0)


# Regression (found by this suite, fixed in the library): attention.py wraps
# transformers.models.llama.modeling_llama.eager_attention_forward for every model ('hf_kvcache_eager'); models whose
# eager attention differs (GPT-NeoX, GPT-2, OPT) crash with AttributeError: no attribute 'num_key_value_groups' once
# the bridge is enabled, even with DynamicCache
def test_bridge_transparent_for_gpt_neox_eager():
    model = build_model("gpt_neox", attn="eager")
    ids = random_ids(2, TOTAL, seed=19)
    before = stream(model, DynamicCache(config=model.config), ids)
    hf_kvcache.enable(model)
    after = stream(model, DynamicCache(config=model.config), ids)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        stream(model, SinkCache(model, sinks=4, window=TOTAL), ids), before, atol=1e-5, rtol=1e-5
    )
