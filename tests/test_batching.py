"""Batched generation with left padding: each row must behave as if generated alone, evictions included."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, build_model, left_pad, random_ids

from hf_kvcache import FullCache, SinkCache, SlidingWindowCache, cache_kwargs

PROMPT_LENGTHS = (10, 17, 13, 20)
NEW = 20

CONFIGS = {
    "sink_cache": ("sink", {"sinks": 2, "window": 6}),
    "sink_original": ("sink", {"sinks": 3, "budget": 8, "position_mode": "original"}),
    "sliding": ("sliding", {"window": 8}),
}


def prompts(seed=0):
    return [random_ids(1, n, seed=seed + n)[0] for n in PROMPT_LENGTHS]


def greedy(model, ids, mask, name, cache_config, **kwargs):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=PAD,
        cache_implementation=name,
        cache_config=cache_config,
        **kwargs,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-eager"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_left_padded_batch_equals_rows_alone(arch, config_name):
    name, cache_config = CONFIGS[config_name]
    model = build_model("llama", attn="eager") if arch == "llama-eager" else build_model(arch)
    rows = prompts()
    ids, mask = left_pad(rows)
    batched = greedy(model, ids, mask, name, cache_config)
    assert batched.shape == (len(rows), ids.shape[1] + NEW)
    new_batched = batched[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = greedy(model, row[None], torch.ones(1, row.numel(), dtype=torch.long), name, cache_config)
        assert torch.equal(alone[0, : row.numel()], row)
        assert torch.equal(new_batched[i], alone[0, row.numel() :]), f"row {i} (prompt length {row.numel()})"


def test_eviction_matters_in_the_batched_test():
    """Guard: the small budgets of these tests really change the output compared with a full cache."""
    model = build_model("llama")
    ids, mask = left_pad(prompts())
    full = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    for name, cache_config in CONFIGS.values():
        out = greedy(model, ids, mask, name, cache_config)
        assert not torch.equal(out, full), (name, cache_config)


def test_left_padded_batch_full_cache_equals_default():
    model = build_model("llama")
    ids, mask = left_pad(prompts())
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=PAD,
        **cache_kwargs(FullCache(model.config)),
    )
    assert torch.equal(out, ref)


def test_sampling_runs_seeded_and_reproducible():
    model = build_model("llama")
    ids, mask = left_pad(prompts())
    for name, cache_config in CONFIGS.values():
        outs = []
        for _ in range(2):
            torch.manual_seed(123)
            outs.append(
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=NEW,
                    do_sample=True,
                    top_k=0,
                    temperature=1.0,
                    pad_token_id=PAD,
                    cache_implementation=name,
                    cache_config=cache_config,
                )
            )
        assert outs[0].shape == (len(PROMPT_LENGTHS), ids.shape[1] + NEW)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0][:, : ids.shape[1]], ids)
        assert int(outs[0].max()) < model.config.vocab_size


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_beam_search_runs_with_evictions(config_name):
    name, cache_config = CONFIGS[config_name]
    model = build_model("llama")
    ids, mask = left_pad(prompts()[:2])
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        num_beams=2,
        pad_token_id=PAD,
        cache_implementation=name,
        cache_config=cache_config,
    )
    assert out.shape == (2, ids.shape[1] + NEW)
    assert torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_beam_search_single_row_with_evictions_matches_padded_batch(config_name):
    """Beam reordering must move every piece of per-row state (slots, sinks, counters) consistently."""
    name, cache_config = CONFIGS[config_name]
    model = build_model("llama")
    rows = prompts()[:2]
    ids, mask = left_pad(rows)
    kw = dict(
        max_new_tokens=NEW,
        do_sample=False,
        num_beams=2,
        pad_token_id=PAD,
        cache_implementation=name,
        cache_config=cache_config,
    )
    batched = model.generate(ids, attention_mask=mask, **kw)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kw)
        assert torch.equal(batched[i, ids.shape[1] :], alone[0, row.numel() :]), f"row {i}"


@pytest.mark.parametrize(
    "name,cache_config",
    [
        ("sink", {"sinks": 4, "window": 64}),
        ("sink", {"budget": 64, "position_mode": "original"}),
        ("sliding", {"window": 64}),
    ],
)
def test_beam_search_large_budget_equals_dynamic(name, cache_config):
    model = build_model("llama")
    ids, mask = left_pad(prompts())
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_beams=2, pad_token_id=PAD)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, cache_implementation=name, cache_config=cache_config, **kw)
    assert torch.equal(out, ref)
    full = model.generate(ids, **cache_kwargs(FullCache(model.config)), **kw)
    assert torch.equal(full, ref)


CACHE_OBJECTS = {
    "sink_cache": lambda m: SinkCache(m.config, sinks=2, window=6),
    "sink_original": lambda m: SinkCache(m.config, sinks=2, window=6, position_mode="original"),
    "sliding": lambda m: SlidingWindowCache(m.config, window=8),
    "full": lambda m: FullCache(m.config),
}


@pytest.mark.parametrize("cache_name", list(CACHE_OBJECTS))
def test_num_return_sequences(cache_name):
    model = build_model("llama")
    ids, mask = left_pad(prompts()[:2])
    # beam search returning both beams
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        num_beams=2,
        num_return_sequences=2,
        pad_token_id=PAD,
        **cache_kwargs(CACHE_OBJECTS[cache_name](model)),
    )
    assert out.shape == (4, ids.shape[1] + NEW)
    assert torch.equal(out[0::2, : ids.shape[1]], ids) and torch.equal(out[1::2, : ids.shape[1]], ids)
    # sampling, two samples per prompt
    torch.manual_seed(0)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=True,
        num_return_sequences=2,
        pad_token_id=PAD,
        **cache_kwargs(CACHE_OBJECTS[cache_name](model)),
    )
    assert out.shape == (4, ids.shape[1] + NEW)
    assert torch.equal(out[0::2, : ids.shape[1]], ids)


def test_num_return_sequences_via_cache_implementation():
    model = build_model("llama")
    ids, mask = left_pad(prompts()[:2])
    for name, cache_config in CONFIGS.values():
        torch.manual_seed(1)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=True,
            num_return_sequences=2,
            pad_token_id=PAD,
            cache_implementation=name,
            cache_config=cache_config,
        )
        assert out.shape == (4, ids.shape[1] + NEW)


@pytest.mark.parametrize("position_mode", ["cache", "original"])
def test_prompts_shorter_than_sinks(position_mode):
    """Rows whose prompt does not even fill the sinks (1 and 2 tokens with 4 sinks) next to a long one."""
    model = build_model("llama")
    rows = [random_ids(1, n, seed=60 + n)[0] for n in (2, 1, 12, 5)]
    ids, mask = left_pad(rows)
    cache_config = {"sinks": 4, "window": 4, "position_mode": position_mode}
    batched = greedy(model, ids, mask, "sink", cache_config)
    for i, row in enumerate(rows):
        alone = greedy(model, row[None], torch.ones(1, row.numel(), dtype=torch.long), "sink", cache_config)
        assert torch.equal(batched[i, ids.shape[1] :], alone[0, row.numel() :]), f"row {i}"


def _feed_padded(model, cache, ids, mask, new, chunk):
    """Prefill a left-padded batch, then feed `new` (same tokens for every row) `chunk` tokens per forward, passing
    mask and positions as generate would. Returns the logits of every fed new token [B, T, V]."""
    n_real = mask.sum(-1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
        for t in range(0, new.shape[1], chunk):
            q = min(chunk, new.shape[1] - t)
            mask = torch.cat((mask, torch.ones(ids.shape[0], q, dtype=torch.long)), -1)
            p = n_real[:, None] + t + torch.arange(q)[None]
            out.append(
                model(
                    new[:, t : t + q], attention_mask=mask, position_ids=p, **cache_kwargs(cache), use_cache=True
                ).logits
            )
    return torch.cat(out, 1)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    "make",
    [
        lambda m: SinkCache(m, sinks=2, window=5),
        lambda m: SinkCache(m, sinks=2, window=5, position_mode="original"),
        lambda m: SlidingWindowCache(m, window=6),
    ],
    ids=["sink_cache", "sink_original", "sliding"],
)
def test_padded_batch_logits_equal_rows_alone_direct_calls(make, chunk):
    """Logit-level check (not just argmax), also for multi-token decode chunks after evictions."""
    model = build_model("llama")
    rows = [random_ids(1, n, seed=70 + n)[0] for n in (10, 3, 17)]
    ids, mask = left_pad(rows)
    new = random_ids(1, 24, seed=77)
    batched = _feed_padded(model, make(model), ids, mask, new.expand(len(rows), -1), chunk)
    for i, row in enumerate(rows):
        alone = _feed_padded(model, make(model), row[None], torch.ones(1, row.numel(), dtype=torch.long), new, chunk)
        torch.testing.assert_close(batched[i], alone[0], atol=1e-4, rtol=1e-4)
