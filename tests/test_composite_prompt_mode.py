"""CompositeCache(compress="prompt"): the regions are filled by the policy through the prompt (as in "always" mode),
the selection is kept at the end of the prompt and later tokens are appended to a growing tail region at the first
window's precision. Against the standalone caches in prompt mode (same logits and kept tokens), "always" mode's
selection right after the prompt, chunked prefill, padding, generate, no host syncs in decode, bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    PAD,
    build_model,
    greedy_decode_syncs,
    left_pad,
    masked_step,
    policy_free_nbytes,
    random_ids,
    teacher_forced_logits,
)

import hf_kvcache
from hf_kvcache import cache_kwargs, returned_cache

PROMPT, STEPS = 20, 8
W = {"role": "window"}


def _kept(cache, layer=0):
    """Per (row, meta head): the sorted position ids of the valid slots (trash slot excluded)."""
    layer = cache.layers[layer]
    valid, pos = layer.slot_valid[..., :-1], layer.head_positions()[..., :-1]
    return [[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])]


STANDALONE = {  # composite regions, and the standalone cache with the same budget that keeps the same tokens
    "h2o": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5}],
        lambda m: hf_kvcache.H2OCache(m, heavy=5, recent=3, compress="prompt", attention_score="accumulated"),
    ),
    "tova": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5, "scorer": "tova"}],
        lambda m: hf_kvcache.TOVACache(m, budget=8, recent=3, compress="prompt"),
    ),
    "knorm": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5, "scorer": "knorm"}],
        lambda m: hf_kvcache.KnormCache(m, budget=8, recent=3, compress="prompt"),
    ),
    "keydiff": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5, "scorer": "keydiff"}],
        lambda m: hf_kvcache.KeyDiffCache(m, budget=8, recent=3, compress="prompt"),
    ),
    "snapkv": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5, "scorer": "snapkv", "window": 3}],
        lambda m: hf_kvcache.SnapKVCache(m, budget=8, window=3, compress="prompt"),
    ),
    "expected_attention": (
        [{**W, "start": 0, "end": 3}, {"role": "heavy", "tokens": 5, "scorer": "expected_attention"}],
        lambda m: hf_kvcache.ExpectedAttentionCache(m, budget=8, recent=3, sinks=0, compress="prompt"),
    ),
    "sinks_window": (
        [{"role": "sinks", "tokens": 2}, {**W, "start": 0, "end": 6}],
        lambda m: hf_kvcache.SinkCache(m, sinks=2, budget=8, compress="prompt"),
    ),
}


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("name", sorted(STANDALONE))
def test_prompt_mode_equals_the_standalone_cache_in_prompt_mode(name, chunk):
    """Same logits at every appended token and the same kept tokens: the standalone's prompt selection, plus every
    token after the prompt."""
    regions, standalone = STANDALONE[name]
    model = build_model("llama")
    ids = random_ids(2, PROMPT + STEPS, seed=21)
    composite = hf_kvcache.CompositeCache(model, regions=regions, compress="prompt")
    want = teacher_forced_logits(model, standalone(model), ids, PROMPT, chunk=chunk)
    got = teacher_forced_logits(model, composite, ids, PROMPT, chunk=chunk)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    standalone_cache = standalone(model)
    teacher_forced_logits(model, standalone_cache, ids, PROMPT, chunk=chunk)
    kept = _kept(composite)
    assert kept == [[sorted(h) for h in row] for row in _kept(standalone_cache)]
    assert all(len(h) == 8 + STEPS and h[-STEPS:] == list(range(PROMPT, PROMPT + STEPS)) for row in kept for h in row)


@pytest.mark.parametrize("chunk", [None, 6])
def test_quantized_regions_keep_the_always_mode_selection_and_grow_a_tail_at_the_first_windows_precision(chunk):
    """Sinks, a full-precision window, an FP8 window and INT8 heavy hitters: at the end of the prompt the kept tokens
    are "always" mode's; the appended ones go to a growing full-precision tail (the first window's precision)."""
    model = build_model("llama")
    ids = random_ids(2, PROMPT + STEPS, seed=22)
    regions = [
        {"role": "sinks", "tokens": 2},
        {**W, "start": 0, "end": 2},
        {**W, "start": 2, "end": 5, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {"role": "heavy", "tokens": 4, "keys": "int8", "values": "int8", "scorer": "snapkv", "window": 4},
    ]
    always = hf_kvcache.CompositeCache(model, regions=regions)
    with torch.no_grad():
        for start in range(0, PROMPT, chunk or PROMPT):
            model(input_ids=ids[:, start : min(PROMPT, start + (chunk or PROMPT))], **cache_kwargs(always))
    cache = hf_kvcache.CompositeCache(model, regions=regions, compress="prompt")
    with torch.no_grad():
        for start in range(0, PROMPT, chunk or PROMPT):
            model(input_ids=ids[:, start : min(PROMPT, start + (chunk or PROMPT))], **cache_kwargs(cache))
    bytes_prompt = cache.nbytes()
    _teacher_forced_rest(model, cache, ids)
    kept = _kept(cache)
    assert kept == [[h + list(range(PROMPT, PROMPT + STEPS)) for h in row] for row in _kept(always)]
    store = cache.layers[0].store
    assert isinstance(store.stores[-1], hf_kvcache.stores.FullPrecisionStore) and len(store.stores) == 5
    assert store.sizes[-1] >= STEPS  # the prompt filled the 11 slots of the regions: the tail holds the rest
    assert cache.nbytes() > bytes_prompt  # it grew
    assert cache.get_seq_length() == PROMPT + STEPS


def _teacher_forced_rest(model, cache, ids):
    with torch.no_grad():
        for t in range(PROMPT, ids.shape[1]):
            model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))


def test_preset_in_prompt_mode_grows_an_fp8_tail():
    model = build_model("llama")
    ids = random_ids(1, PROMPT + STEPS, seed=23)
    cache = hf_kvcache.CompositeCache(model, preset="sinks_heavy_recent", budget=12, compress="prompt")
    teacher_forced_logits(model, cache, ids, PROMPT)
    store = cache.layers[0].store
    tail, window = store.stores[-1], store.stores[1]
    assert type(tail) is type(window) and not isinstance(tail, hf_kvcache.stores.FullPrecisionStore)
    assert all(len(h) == 12 + STEPS for h in _kept(cache)[0])


@pytest.mark.parametrize("scorer", ["h2o", "expected_attention"])
def test_padded_batch_generates_each_row_as_alone(scorer):
    model = build_model("llama")
    rows = [random_ids(1, n, seed=70 + n)[0] for n in (14, 21, 17)]
    ids, mask = left_pad(rows)
    regions = [
        {"role": "sinks", "tokens": 2},
        {**W, "start": 0, "end": 3},
        {"role": "heavy", "tokens": 4, "scorer": scorer, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
    ]
    kwargs = dict(
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=PAD,
        cache_implementation="composite",
        cache_config={"regions": regions, "compress": "prompt", "sink_positions": "original"},
    )
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), f"row {i}"


def test_generate_cache_config_equals_the_cache_object_and_grows():
    model = build_model("llama")
    ids = random_ids(2, PROMPT, seed=24)
    config = {"preset": "sinks_heavy_recent", "budget": 10, "compress": "prompt"}
    by_name = model.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        cache_implementation="composite",
        cache_config=config,
        return_dict_in_generate=True,
    )
    by_object = model.generate(
        ids, max_new_tokens=8, do_sample=False, **cache_kwargs(hf_kvcache.CompositeCache(model, **config))
    )
    assert torch.equal(by_name.sequences, by_object)
    assert returned_cache(by_name).layers[0].used == 10 + 7  # grew by the generated tokens after the prompt


@pytest.mark.parametrize("scorer", ["h2o", "snapkv", "expected_attention"])
def test_decode_after_the_prompt_never_syncs(scorer):
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    ids, mask = left_pad([random_ids(1, 16, seed=25)[0], random_ids(1, 12, seed=26)[0]])
    cache = hf_kvcache.CompositeCache(
        model,
        compress="prompt",
        regions=[
            {"role": "sinks", "tokens": 2},
            {**W, "start": 0, "end": 3, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
            {"role": "heavy", "tokens": 4, "scorer": scorer, **({"window": 3} if scorer == "snapkv" else {})},
        ],
    )
    assert greedy_decode_syncs(model, cache, ids, mask, steps=5) == [{}] * 5


def test_bad_compress_values_are_refused_naming_the_parameter():
    config = build_model("llama", num_hidden_layers=1).config
    with pytest.raises(ValueError, match=r"`compress` must be one of \('always', 'prompt'\), got 'decode'"):
        hf_kvcache.CompositeCache(config, preset="sinks_heavy_recent", budget=10, compress="decode")
    with pytest.raises(ValueError, match=r"compress='prompt': regions\[1\] \('rest'\) keeps every token already"):
        hf_kvcache.CompositeCache(config, compress="prompt", regions=[{**W, "start": 0, "end": 4}, {"role": "rest"}])


def test_end_prompt_appends_a_question_uncompressed_and_crop_stays_in_the_appended_tokens():
    model = build_model("llama")
    ids = random_ids(1, 30, seed=27)
    regions = [
        {"role": "sinks", "tokens": 2},
        {**W, "start": 0, "end": 3, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {"role": "heavy", "tokens": 3, "scorer": "keydiff"},
    ]
    cache = hf_kvcache.CompositeCache(model, regions=regions, compress="prompt")
    always = hf_kvcache.CompositeCache(model, regions=regions)
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(always))
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(cache))
        cache.end_prompt()
        model(input_ids=ids[:, PROMPT:26], **cache_kwargs(cache))  # the question: one multi-token forward
        model(input_ids=ids[:, 26:27], **cache_kwargs(cache))
    assert _kept(cache) == [[h + list(range(PROMPT, 27)) for h in row] for row in _kept(always)]
    cache.crop(-2)
    assert cache.get_seq_length() == 25 and all(h[-1] == 24 for h in _kept(cache)[0])
    with pytest.raises(ValueError, match="compressed"):
        cache.crop(-6)  # 25 - 6 = 19 < the 20-token prompt


@pytest.mark.parametrize("prompt", [1, 5, 9])
def test_a_prompt_within_the_budget_is_never_evicted_equal_to_dynamic_cache(prompt):
    """Nothing is evicted from a prompt that fits: appended after the regions' used slots (holes in a ring not yet
    full included), every token is kept and the logits are DynamicCache's."""
    from transformers import DynamicCache

    model = build_model("llama")
    ids = random_ids(2, 24, seed=28)
    layouts = [
        [{"role": "sinks", "tokens": 2}, {**W, "start": 0, "end": 4}, {"role": "heavy", "tokens": 6}],  # pooled
        [
            {"role": "sinks", "tokens": 2},
            {**W, "start": 0, "end": 2},
            {**W, "start": 2, "end": 5, "keys": "none", "values": "none"},
            {"role": "heavy", "tokens": 6, "scorer": "expected_attention"},
        ],
        [
            {"role": "sinks", "tokens": 2},
            {**W, "start": 0, "end": 3},
            {**W, "start": 3, "end": 9, "keys": "none", "values": "none"},
        ],
    ]

    def run(cache):
        with torch.no_grad():
            model(input_ids=ids[:, :prompt], **cache_kwargs(cache))
            return torch.cat(
                [model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(prompt, ids.shape[1])],
                1,
            )

    want = run(DynamicCache(config=model.config))
    for regions in layouts:
        cache = hf_kvcache.CompositeCache(model, regions=regions, compress="prompt", sink_positions="original")
        torch.testing.assert_close(run(cache), want, atol=1e-4, rtol=1e-4)
        assert all(h == list(range(ids.shape[1])) for row in _kept(cache) for h in row)


@pytest.mark.parametrize("scorer", ["h2o", "tova", "knorm", "keydiff", "snapkv", "expected_attention"])
def test_the_end_of_the_prompt_frees_the_heavy_scorers_state(scorer):
    """The heavy region's scorer state (and the policy's scores, stream indices, sink key copies) is held through the
    prompt and freed at its end: nbytes() is then the stores, positions and validity alone. Reordering and selecting
    rows afterwards give the logits of the same rows without them."""
    model = build_model("llama")
    ids, mask = left_pad([random_ids(1, PROMPT, seed=29)[0], random_ids(1, PROMPT - 6, seed=30)[0]])
    regions = [
        {"role": "sinks", "tokens": 2},
        {**W, "start": 0, "end": 3, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {
            "role": "heavy",
            "tokens": 4,
            "keys": "int8",
            "values": "int8",
            "scorer": scorer,
            **({"window": 3} if scorer == "snapkv" else {}),
        },
    ]
    caches = [hf_kvcache.CompositeCache(model, regions=regions, compress="prompt") for _ in range(2)]
    tokens = random_ids(2, 4, seed=31)
    for cache in caches:
        _, m = masked_step(model, cache, ids, mask[:, :0].long())
        assert cache.nbytes() > policy_free_nbytes(cache)
        for t in range(3):
            _, m = masked_step(model, cache, tokens[:, t : t + 1], m)
            assert cache.nbytes() == policy_free_nbytes(cache)
    want, _ = masked_step(model, caches[0], tokens[:, 3:], m)
    swap = torch.tensor([1, 0])
    caches[1].reorder_cache(swap)
    got, _ = masked_step(model, caches[1], tokens[swap, 3:], m[swap])
    torch.testing.assert_close(got, want[swap], atol=1e-5, rtol=1e-5)
    caches[1].batch_select_indices(torch.tensor([1]))
    assert caches[1].nbytes() == policy_free_nbytes(caches[1])
