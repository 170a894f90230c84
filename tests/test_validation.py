"""Bad parameters and unsupported models get clear errors; crop works exactly while nothing was evicted."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import build_config, build_model, left_pad, random_ids
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import FullCache, SinkCache, SlidingWindowCache, cache_kwargs, returned_cache


@pytest.fixture(scope="module")
def cfg():
    return build_config("llama")


# -- parameter values -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, -1, -16])
def test_budget_must_be_positive(cfg, budget):
    with pytest.raises(ValueError, match="budget"):
        SinkCache(cfg, sinks=0, budget=budget)


@pytest.mark.parametrize("window", [0, -3])
def test_window_must_be_positive(cfg, window):
    with pytest.raises(ValueError, match="window"):
        SinkCache(cfg, sinks=4, window=window)
    with pytest.raises(ValueError, match="window"):
        SlidingWindowCache(cfg, window=window)


def test_negative_sinks(cfg):
    with pytest.raises(ValueError, match="sinks"):
        SinkCache(cfg, sinks=-1, window=8)


@pytest.mark.parametrize("sinks,budget", [(9, 8), (8, 8), (1, 1)])
def test_sinks_must_be_smaller_than_budget(cfg, sinks, budget):
    with pytest.raises(ValueError, match="sinks") as err:
        SinkCache(cfg, sinks=sinks, budget=budget)
    assert "budget" in str(err.value)


def test_sinks_zero_and_budget_one_are_valid(cfg):
    cache = SinkCache(cfg, sinks=0, budget=1)
    assert (cache.sinks, cache.window) == (0, 1)
    cache = SinkCache(cfg, sinks=7, budget=8)
    assert (cache.sinks, cache.window) == (7, 1)


@pytest.mark.parametrize("bad", [2.5, "8", True, 8.0, None])
@pytest.mark.parametrize("param", ["sinks", "window", "budget"])
def test_non_integer_parameters(cfg, param, bad):
    kwargs = {"sinks": 2, "window": 8}
    if param == "budget":
        kwargs = {"sinks": 2, "budget": bad}
    else:
        kwargs[param] = bad
    if param == "window" and bad is None:
        pytest.skip("window=None means 'give budget instead' (tested separately)")
    with pytest.raises(ValueError, match=param):
        SinkCache(cfg, **kwargs)


@pytest.mark.parametrize("bad", [2.5, "8", True, None])
def test_sliding_window_non_integer(cfg, bad):
    with pytest.raises(ValueError, match="window"):
        SlidingWindowCache(cfg, window=bad)


def test_numpy_and_torch_integers_accepted(cfg):
    import numpy as np

    cache = SinkCache(cfg, sinks=np.int64(2), window=np.int32(6))
    assert (cache.sinks, cache.window) == (2, 6) and type(cache.window) is int


def test_window_and_budget_exclusive(cfg):
    with pytest.raises(ValueError, match="window") as err:
        SinkCache(cfg, sinks=2)
    assert "budget" in str(err.value)
    with pytest.raises(ValueError, match="budget"):
        SinkCache(cfg, sinks=2, window=6, budget=8)


@pytest.mark.parametrize("mode", ["Cache", "absolute", "", None, 1])
def test_unknown_position_mode(cfg, mode):
    with pytest.raises(ValueError, match="position_mode") as err:
        SinkCache(cfg, sinks=2, window=6, position_mode=mode)
    assert "original" in str(err.value)


def test_first_argument_must_be_model_or_config():
    with pytest.raises(ValueError, match="config"):
        SinkCache("meta-llama/Llama-2-7b", sinks=2, window=6)
    with pytest.raises(ValueError, match="config"):
        FullCache({"num_hidden_layers": 2})


# -- unsupported models -----------------------------------------------------------------------------------------
def gpt2_config():
    return transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, bos_token_id=1, eos_token_id=2
    )


def test_cache_mode_needs_rope():
    with pytest.raises(ValueError, match="position_mode") as err:
        SinkCache(gpt2_config(), sinks=4, window=8)
    assert "original" in str(err.value) and "RoPE" in str(err.value)


def test_original_mode_without_rope_is_accepted_and_runs():
    config = gpt2_config()
    cache = SinkCache(config, sinks=4, window=8, position_mode="original")
    assert len(cache.layers) == 2
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = random_ids(1, 10)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(
        ids,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="sink",
        cache_config={"sinks": 4, "window": 40, "position_mode": "original"},
    )
    assert torch.equal(out, ref)
    # and sliding (no positions involved) too
    out = model.generate(
        ids,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="sliding",
        cache_config={"window": 40},
    )
    assert torch.equal(out, ref)


ENC_DEC = [transformers.T5Config, transformers.BartConfig]


@pytest.mark.parametrize("config_cls", ENC_DEC)
def test_encoder_decoder_rejected(config_cls):
    for make in (
        lambda c: SinkCache(c, sinks=4, window=8, position_mode="original"),
        lambda c: SlidingWindowCache(c, window=8),
        lambda c: FullCache(c),
    ):
        with pytest.raises(ValueError, match="encoder-decoder"):
            make(config_cls())


# Regression (found by this suite, fixed in the library): SinkCache.__init__ builds the KeyRotator (RoPE check) before
# KVCache.__init__ runs check_supported_config, so an encoder-decoder config gets the misleading 'use
# position_mode=original' error
@pytest.mark.parametrize("config_cls", ENC_DEC)
def test_encoder_decoder_rejected_as_such_in_default_mode(config_cls):
    with pytest.raises(ValueError, match="encoder-decoder"):
        SinkCache(config_cls(), sinks=4, window=8)


def test_enable_rejects_encoder_decoder_and_non_models():
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(config)
    with pytest.raises(ValueError, match="encoder-decoder"):
        hf_kvcache.enable(model)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        hf_kvcache.enable(config)


# -- the attention bridge -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda c: SinkCache(c, sinks=2, window=6),
        lambda c: SinkCache(c, sinks=2, window=6, position_mode="original"),
        lambda c: SlidingWindowCache(c, window=8),
        lambda c: FullCache(c),
    ],
)
def test_direct_call_without_bridge_raises(make):
    model = build_model("llama")
    cache = make(model.config)
    with pytest.raises(RuntimeError, match="enable"), torch.no_grad():
        model(random_ids(1, 5), **cache_kwargs(cache), use_cache=True)
    # after enabling, the same kind of call works
    hf_kvcache.enable(model)
    cache = make(model.config)
    with torch.no_grad():
        out = model(random_ids(1, 5), **cache_kwargs(cache), use_cache=True)
    assert out.logits.shape == (1, 5, model.config.vocab_size)
    assert cache.get_seq_length() == 5


def test_cache_from_model_enables_bridge():
    model = build_model("llama")
    assert model.config._attn_implementation == "sdpa"
    cache = SinkCache(model, sinks=2, window=6)
    assert model.config._attn_implementation == "hf_kvcache_sdpa"
    with torch.no_grad():
        model(random_ids(1, 9), **cache_kwargs(cache), use_cache=True)  # no RuntimeError: the bridge is on
    assert cache.get_seq_length() == 9


# Regression (found by this suite, fixed in the library): attention.enable registers its forward pre-hook only on the
# top-level model (e.g. LlamaForCausalLM); calling the enabled model's base model (model.model(...)) with one of our
# caches raises the RuntimeError that asks to call hf_kvcache.enable(model), which was already done
def test_base_model_of_enabled_model_accepts_our_cache():
    model = build_model("llama")
    ids = random_ids(1, 12, seed=8)
    cache = SinkCache(model, sinks=2, window=20)  # enables the bridge on `model`
    with torch.no_grad():
        ref = model.model(ids, **cache_kwargs(DynamicCache(config=model.config))).last_hidden_state
        out = model.model(ids, **cache_kwargs(cache)).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prepared_four_d_mask_equals_the_padding_mask_and_three_d_is_rejected():
    """generate hands compileable caches transformers' prepared 4-D mask: each new token's validity is read from it."""
    model = build_model("llama")
    ids = random_ids(1, 5)
    with torch.no_grad():
        plain = model(
            ids,
            attention_mask=torch.ones(1, 5, dtype=torch.long),
            **cache_kwargs(SinkCache(model, sinks=2, window=6)),
            use_cache=True,
        ).logits
        causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
        prepared = model(
            ids, attention_mask=causal, **cache_kwargs(SinkCache(model, sinks=2, window=6)), use_cache=True
        ).logits
    torch.testing.assert_close(prepared, plain)
    with pytest.raises(ValueError, match="2-D"), torch.no_grad():
        model(
            ids, attention_mask=torch.ones(1, 5, 5), **cache_kwargs(SinkCache(model, sinks=2, window=6)), use_cache=True
        )


# -- crop ------------------------------------------------------------------------------------------------------------
def run(model, cache, ids, attention_mask=None, position_ids=None):
    with torch.no_grad():
        return model(
            ids, attention_mask=attention_mask, position_ids=position_ids, **cache_kwargs(cache), use_cache=True
        ).logits


CROPPABLE = {
    "sink_cache": lambda m: SinkCache(m, sinks=2, window=18),
    "sink_original": lambda m: SinkCache(m, sinks=2, window=18, position_mode="original"),
    "sliding": lambda m: SlidingWindowCache(m, window=20),
    "full": lambda m: FullCache(m),
}


@pytest.mark.parametrize("cache_name", list(CROPPABLE))
def test_crop_before_eviction_matches_dynamic_cache(cache_name):
    model = build_model("llama")
    ids = random_ids(2, 12, seed=1)
    new = random_ids(2, 6, seed=2)
    results = []
    for cache in (DynamicCache(config=model.config), CROPPABLE[cache_name](model)):
        logits = [run(model, cache, ids[:, :8])]
        for t in range(8, 12):
            logits.append(run(model, cache, ids[:, t : t + 1]))
        assert cache.is_croppable
        cache.crop(-5)
        assert cache.get_seq_length() == 7
        logits.append(run(model, cache, new[:, :3]))  # multi-token forward after crop
        for t in range(3, 6):
            logits.append(run(model, cache, new[:, t : t + 1]))
        results.append(torch.cat(logits, 1))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_name", list(CROPPABLE))
def test_crop_zero_is_noop_and_positive_rejected(cache_name):
    model = build_model("llama")
    cache = CROPPABLE[cache_name](model)
    run(model, cache, random_ids(1, 6))
    cache.crop(0)
    assert cache.get_seq_length() == 6
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


@pytest.mark.parametrize("cache_name", ["sink_cache", "sink_original"])
def test_crop_into_sinks_of_padded_batch_matches_dynamic_cache(cache_name):
    """Crop back into the sink region of a left-padded batch: dropped sinks must be freed and refilled correctly."""
    model = build_model("llama")
    rows = [random_ids(1, n, seed=30 + n)[0] for n in (9, 5)]
    ids, mask = left_pad(rows)  # row 1 has 4 pads; its sinks are stream indices 4, 5
    new = random_ids(2, 5, seed=3)
    results = []
    for cache in (DynamicCache(config=model.config), CROPPABLE[cache_name](model)):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first = run(model, cache, ids, attention_mask=mask, position_ids=pos)
        cache.crop(-4)  # keeps 5 stream columns: row 1 keeps its first real token only
        kept_mask = torch.cat((mask[:, :5], torch.ones(2, 5, dtype=torch.long)), -1)
        new_pos = (kept_mask.cumsum(-1) - 1)[:, 5:]
        after = [run(model, cache, new[:, :2], attention_mask=kept_mask[:, :7], position_ids=new_pos[:, :2])]
        for t in range(2, 5):
            after.append(
                run(
                    model,
                    cache,
                    new[:, t : t + 1],
                    attention_mask=kept_mask[:, : 6 + t],
                    position_ids=new_pos[:, t : t + 1],
                )
            )
        results.append((first, torch.cat(after, 1)))
    real = mask.bool()
    torch.testing.assert_close(results[1][0][real], results[0][0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_name", ["sink_cache", "sink_original", "sliding"])
def test_crop_after_eviction_raises(cache_name):
    model = build_model("llama")
    cache = CROPPABLE[cache_name](model)
    ids = random_ids(1, 21, seed=4)
    run(model, cache, ids[:, :20])
    assert cache.is_croppable  # exactly at the budget: nothing evicted yet
    run(model, cache, ids[:, 20:21])
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="evict"):
        cache.crop(-1)
    assert cache.get_seq_length() == 21


def test_full_cache_crop_after_long_stream():
    model = build_model("llama")
    cache, dyn = FullCache(model), DynamicCache(config=model.config)
    ids = random_ids(1, 40, seed=5)
    for c in (cache, dyn):
        run(model, c, ids[:, :30])
        c.crop(-10)
    torch.testing.assert_close(run(model, cache, ids[:, 30:]), run(model, dyn, ids[:, 30:]), atol=1e-5, rtol=1e-5)


# -- assisted decoding (crop in generate) ------------------------------------------------------------------------------
def test_assisted_decoding_before_eviction_matches_default():
    model, assistant = build_model("llama"), build_model("llama", seed=5)
    ids = random_ids(1, 10, seed=6)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(ref, model.generate(ids, max_new_tokens=12, do_sample=False))
    for cache in (
        SinkCache(model.config, sinks=2, window=40),
        SlidingWindowCache(model.config, window=40),
        FullCache(model.config),
    ):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant, **cache_kwargs(cache))
        assert torch.equal(out, ref), type(cache).__name__


def test_assisted_decoding_after_eviction_raises_clear_error():
    model, assistant = build_model("llama"), build_model("llama", seed=5)
    with pytest.raises(ValueError, match="evict"):
        model.generate(
            random_ids(1, 10, seed=6),
            max_new_tokens=12,
            do_sample=False,
            assistant_model=assistant,
            **cache_kwargs(SinkCache(model.config, sinks=2, window=4)),
        )


def test_generate_sink_without_size_uses_the_documented_default():
    model = build_model("llama")  # max_position_embeddings 1024: the default 4 + 1020 fits as is
    out = model.generate(random_ids(1, 5), max_new_tokens=3, cache_implementation="sink", return_dict_in_generate=True)
    cache = returned_cache(out)
    assert isinstance(cache, hf_kvcache.SinkCache) and (cache.sinks, cache.window) == (4, 1020)
