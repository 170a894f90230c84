"""compress="prompt" (hf_kvcache.policies.prompt_mode): the prompt is compressed to the budget by the cache's own
policy, then every token is appended and nothing is evicted. Exact against a full cache whose attention mask hides
the evicted prompt tokens; kept set equal to "always" mode's right after the prompt; chunked prefill, end_prompt(),
padding, generate's cache_config, the harness's budget fractions, decode without host syncs."""

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
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import CACHE_IMPLEMENTATIONS, cache_kwargs, returned_cache
from hf_kvcache.evaluation.cache_spec import check_cache

PROMPT, STEPS, BUDGET = 20, 8, 8
EVICTING = {
    "sink": {"sinks": 2, "budget": BUDGET},
    "sliding": {"window": BUDGET},
    "h2o": {"budget": BUDGET},
    "random_eviction": {"budget": BUDGET},
    "knorm": {"budget": BUDGET},
    "keydiff": {"budget": BUDGET},
    "tova": {"budget": BUDGET},
    "snapkv": {"budget": BUDGET, "window": 3},
    "expected_attention": {"budget": BUDGET, "future": 16},
}
#: the scorers' prompt-mode recent windows (the papers'), which "always" mode widens by default
PROMPT_WINDOWS = {
    "knorm": {"recent": 0},
    "keydiff": {"recent": 0},
    "tova": {"recent": 1},
    "snapkv": {"recent": 3},
    "expected_attention": {"recent": 0},
}


def _kept(cache, layer=0):
    """Per (row, meta head): the set of position ids held in valid slots."""
    layer = cache.layers[layer]
    valid, pos = layer.slot_valid[..., : layer.used], layer.head_positions()[..., : layer.used]
    return [[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])]


@pytest.mark.parametrize(
    "name,config",
    [("sliding", {"window": BUDGET}), ("sink", {"sinks": 2, "budget": BUDGET, "position_mode": "original"})],
)
def test_equals_a_full_cache_with_the_evicted_prompt_tokens_masked(name, config):
    model = build_model("llama")
    ids = random_ids(1, PROMPT + STEPS, seed=7)
    got = teacher_forced_logits(model, CACHE_IMPLEMENTATIONS[name](model, **config, compress="prompt"), ids, PROMPT)
    sinks = config.get("sinks", 0)
    visible = torch.ones(1, PROMPT + STEPS, dtype=torch.long)
    visible[0, sinks : PROMPT - (BUDGET - sinks)] = 0  # what the policy evicts at the end of the prompt
    reference, cache = [], DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(cache))
        for t in range(PROMPT, PROMPT + STEPS):
            out = model(
                input_ids=ids[:, t : t + 1],
                attention_mask=visible[:, : t + 1],
                position_ids=torch.tensor([[t]]),
                **cache_kwargs(cache),
            )
            reference.append(out.logits[:, -1])
    reference = torch.stack(reference, 1)
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    always = teacher_forced_logits(model, CACHE_IMPLEMENTATIONS[name](model, **config), ids, PROMPT)
    assert not torch.allclose(always, reference, atol=1e-3)  # decode-time eviction really differs


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("name", sorted(EVICTING))
def test_keeps_the_policys_prompt_choice_then_appends(name, chunk):
    model = build_model("llama")
    ids = random_ids(1, PROMPT + STEPS, seed=8)
    prompt_cache = CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], compress="prompt")
    always = CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], **PROMPT_WINDOWS.get(name, {}))
    with torch.no_grad():
        step = chunk or PROMPT
        for start in range(0, PROMPT, step):
            model(input_ids=ids[:, start : min(PROMPT, start + step)], **cache_kwargs(always))
    chosen = _kept(always)
    teacher_forced_logits(model, prompt_cache, ids, PROMPT, chunk=chunk)
    for row_always, row_prompt in zip(chosen, _kept(prompt_cache)):
        for heads_always, heads_prompt in zip(row_always, row_prompt):
            assert len(heads_always) == BUDGET
            assert heads_prompt == heads_always + list(range(PROMPT, PROMPT + STEPS))
    layer = prompt_cache.layers[0]
    assert layer.used == BUDGET + STEPS and layer.get_seq_length() == PROMPT + STEPS


def test_end_prompt_appends_the_question_uncompressed():
    model = build_model("llama")
    ids = random_ids(1, 30, seed=9)
    cache = hf_kvcache.H2OCache(model, budget=BUDGET, compress="prompt")
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(cache))
        cache.end_prompt()
        model(input_ids=ids[:, PROMPT:26], **cache_kwargs(cache))  # the question: a multi-token forward
        model(input_ids=ids[:, 26:27], **cache_kwargs(cache))
    kept = _kept(cache)[0]
    assert all(h[-7:] == list(range(PROMPT, 27)) and len(h) == BUDGET + 7 for h in kept)
    always = hf_kvcache.H2OCache(model, budget=BUDGET, compress="always")
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], **cache_kwargs(always))
        always.end_prompt()  # no effect in "always" mode
        model(input_ids=ids[:, PROMPT:26], **cache_kwargs(always))
    assert all(len(h) == BUDGET for h in _kept(always)[0])


@pytest.mark.parametrize("name", ["sink", "h2o", "knorm", "tova", "expected_attention"])
def test_padded_batch_generates_each_row_as_alone(name):
    model = build_model("llama")
    rows = [random_ids(1, n, seed=60 + n)[0] for n in (14, 21, 17)]
    ids, mask = left_pad(rows)
    kwargs = dict(
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=PAD,
        cache_implementation=name,
        cache_config={**EVICTING[name], "compress": "prompt"},
    )
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), f"row {i}"


@pytest.mark.parametrize("name", ["sink", "h2o", "keydiff", "snapkv"])
def test_generate_cache_config_equals_the_cache_object(name):
    model = build_model("llama")
    ids = random_ids(2, PROMPT, seed=10)
    config = {**EVICTING[name], "compress": "prompt"}
    by_name = model.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        cache_implementation=name,
        cache_config=config,
        return_dict_in_generate=True,
    )
    by_object = model.generate(
        ids, max_new_tokens=8, do_sample=False, **cache_kwargs(CACHE_IMPLEMENTATIONS[name](model, **config))
    )
    assert torch.equal(by_name.sequences, by_object)
    assert returned_cache(by_name).layers[0].used == BUDGET + 7  # grew by the generated tokens after the prompt


@pytest.mark.parametrize("name", ["sink", "h2o", "knorm", "keydiff", "tova", "snapkv", "expected_attention"])
def test_decode_after_the_prompt_never_syncs(name):
    model = build_model("llama", num_hidden_layers=3)
    hf_kvcache.enable(model)
    ids, mask = left_pad([random_ids(1, 16, seed=11)[0], random_ids(1, 12, seed=12)[0]])
    cache = CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], compress="prompt")
    assert greedy_decode_syncs(model, cache, ids, mask, steps=6) == [{}] * 6


def test_budget_fractions_in_the_harness_and_bad_modes():
    assert check_cache("knorm", {"budget": "20%", "compress": "prompt"}, context_len=100) == {
        "budget": 20,
        "compress": "prompt",
    }
    assert check_cache("h2o", {"budget": 0.1, "compress": "prompt"}, context_len=200)["budget"] == 20
    with pytest.raises(ValueError, match="compress"):
        hf_kvcache.SinkCache(build_model("llama").config, budget=8, compress="decode")


def test_crop_inside_the_appended_tokens_only():
    model = build_model("llama")
    ids = random_ids(1, PROMPT + 4, seed=13)
    cache = hf_kvcache.SlidingWindowCache(model, window=BUDGET, compress="prompt")
    teacher_forced_logits(model, cache, ids, PROMPT)
    cache.crop(-2)
    assert cache.get_seq_length() == PROMPT + 2 and _kept(cache)[0][0][-1] == PROMPT + 1
    with pytest.raises(ValueError, match="compressed"):
        cache.crop(-3)


def _padded_prompt():
    return left_pad([random_ids(1, PROMPT, seed=14)[0], random_ids(1, PROMPT - 5, seed=15)[0]])


@pytest.mark.parametrize("end", ["decode", "end_prompt"])
@pytest.mark.parametrize("name", sorted(EVICTING))
def test_the_end_of_the_prompt_frees_the_policys_state(name, end):
    """Held during the prompt, gone from its end (the first one-token forward, or end_prompt() and a question) on:
    nbytes() is the layers' stores, positions and validity alone, through later decode steps."""
    model = build_model("llama")
    ids, mask = _padded_prompt()
    cache = CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], compress="prompt")
    logits, mask = masked_step(model, cache, ids, mask[:, :0].long())
    assert cache.nbytes() > policy_free_nbytes(cache)  # the policy's state, needed to choose the prompt's tokens
    if end == "end_prompt":
        cache.end_prompt()
        logits, mask = masked_step(model, cache, random_ids(2, 3, seed=16), mask)
    for _ in range(3):
        logits, mask = masked_step(model, cache, logits.argmax(-1, keepdim=True), mask)
        assert cache.nbytes() == policy_free_nbytes(cache)
    assert all(layer.policy.inner.nbytes() == 0 for layer in cache.compressed_layers)


@pytest.mark.parametrize("name", ["h2o", "snapkv", "expected_attention", "sink"])
def test_reorder_select_and_crop_after_the_prompt(name):
    """The freed state is not needed: beam reordering, batch selection and crop (within the appended tokens) give
    the logits of the same cache without them."""
    model = build_model("llama")
    ids, mask = _padded_prompt()
    caches = [CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], compress="prompt") for _ in range(3)]
    tokens = random_ids(2, 4, seed=17)
    masks = []
    for cache in caches:
        _, m = masked_step(model, cache, ids, mask[:, :0].long())
        for t in range(3):
            _, m = masked_step(model, cache, tokens[:, t : t + 1], m)
        masks.append(m)
    want, _ = masked_step(model, caches[0], tokens[:, 3:], masks[0])
    swap = torch.tensor([1, 0])
    caches[1].reorder_cache(swap)
    got, _ = masked_step(model, caches[1], tokens[swap, 3:], masks[1][swap])
    torch.testing.assert_close(got, want[swap], atol=1e-5, rtol=1e-5)
    caches[2].batch_select_indices(torch.tensor([1]))
    got, _ = masked_step(model, caches[2], tokens[1:, 3:], masks[2][1:])
    torch.testing.assert_close(got, want[1:], atol=1e-5, rtol=1e-5)
    caches[0].crop(-2)  # the last two appended tokens
    _, m = masked_step(model, caches[0], tokens[:, 2:3], masks[0][:, :-1])
    again, _ = masked_step(model, caches[0], tokens[:, 3:], m)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)
    assert caches[0].nbytes() == policy_free_nbytes(caches[0])


@pytest.mark.parametrize("name", ["h2o", "snapkv", "expected_attention", "sink"])
def test_a_state_file_saved_after_the_prompt_has_no_policy_tensors_and_resumes(name, tmp_path):
    from safetensors import safe_open

    from hf_kvcache import load_cache_state, save_cache_state

    model = build_model("llama")
    ids, mask = _padded_prompt()
    cache = CACHE_IMPLEMENTATIONS[name](model, **EVICTING[name], compress="prompt")
    logits, mask = masked_step(model, cache, ids, mask[:, :0].long())
    logits, mask = masked_step(model, cache, logits.argmax(-1, keepdim=True), mask)
    path = tmp_path / "state.safetensors"
    save_cache_state(cache, path)
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
    assert any("slot_valid" in n for n in names) and not [n for n in names if ".policy." in n]
    loaded = load_cache_state(path, model)
    token = logits.argmax(-1, keepdim=True)
    for _ in range(2):
        want, next_mask = masked_step(model, cache, token, mask)
        got, _ = masked_step(model, loaded, token, mask)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        token, mask = want.argmax(-1, keepdim=True), next_mask
