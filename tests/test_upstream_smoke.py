"""A smoke of every cache on the installed transformers: by name and as an object through `generate`, resumed from a
returned cache, and transformers' continuous batching with every page format. Marked `upstream` (with
tests/test_upstream_contracts.py): CI runs these on the oldest supported transformers, `make test-latest` on the
newest release, besides the full suite on the locked one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

import hf_kvcache
from hf_kvcache.paged.spec import KV_DTYPES

pytestmark = pytest.mark.upstream

PROMPT, NEW = 24, 6
#: settings small enough that every evicting cache evicts during the smoke (prompt 24 + 6 new tokens)
SMALL = {
    "sink": {"sinks": 2, "window": 10},
    "sliding": {"window": 12},
    "h2o": {"heavy": 6, "recent": 6},
    "random_eviction": {"heavy": 6, "recent": 6},
    "composite": {"budget": 14},
    "snapkv": {"budget": 12, "window": 4},
    "kivi": {"residual": 8, "group_size": 8},
    "kvzip": {"budget": 12, "request_ids": {"first": [5, 6, 7], "next": [8, 9], "suffix": [10]}},
}  # no tokenizer


@pytest.mark.parametrize("name", sorted(hf_kvcache.CACHE_IMPLEMENTATIONS))
def test_every_cache_generates_by_name_and_as_an_object(name):
    model = build_model("llama")
    ids = random_ids(2, PROMPT, seed=3)
    config = SMALL.get(name, {})
    if name == "kvzap":  # a surrogate shaped for this random model (none is trained for it)
        from test_kvzap import planted

        config = {"budget": 12, "surrogate": planted(model)}
    by_name = model.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        cache_implementation=name,
        cache_config=config,
        return_dict_in_generate=True,
    )
    cache = hf_kvcache.build_cache(name, model, config)
    as_object = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **hf_kvcache.cache_kwargs(cache)
    )
    assert by_name.sequences.shape == (2, PROMPT + NEW)
    assert torch.equal(by_name.sequences, as_object.sequences)  # the same cache, built two ways
    returned = hf_kvcache.returned_cache(as_object)
    assert returned is cache and returned.get_seq_length() == PROMPT + NEW - 1
    assert type(hf_kvcache.returned_cache(by_name)) is hf_kvcache.CACHE_IMPLEMENTATIONS[name]
    # the returned cache resumes: one more forward on it is finite and counts the token
    step = model(input_ids=as_object.sequences[:, -1:], **hf_kvcache.cache_kwargs(returned), use_cache=True)
    assert torch.isfinite(step.logits).all() and returned.get_seq_length() == PROMPT + NEW


def test_full_cache_equals_transformers_dynamic_cache():
    """The keep-everything preset through the bridge produces transformers' own tokens: the bridge is transparent."""
    model = build_model("llama")
    ids = random_ids(2, PROMPT, seed=5)
    ours = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, **hf_kvcache.cache_kwargs(hf_kvcache.FullCache(model))
    )
    theirs = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, **hf_kvcache.cache_kwargs(DynamicCache(config=model.config))
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_continuous_batching_with_every_page_format(kv_dtype):
    model = build_model("llama")
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (7, 12, 20)]
    cb = ContinuousBatchingConfig(num_blocks=24, page_size=8, max_batch_tokens=64, allow_block_sharing=False)
    cb.kv_cache_dtype = kv_dtype
    greedy = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
    from hf_kvcache.evaluation.agreement import record_logits

    with record_logits(model) as rec:
        out = model.generate_batch(prompts, generation_config=greedy, continuous_batching_config=cb, warmup=False)
    assert all(o.error is None for o in out.values()) and len(out) == len(prompts)
    assert all(len(o.generated_tokens) == NEW for o in out.values())
    assert rec.cache_facts["cache_class"] == "QuantizedPagedAttentionCache"
    model_bytes = (
        2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    )
    per_token = rec.cache_facts["bytes_per_token_per_layer"]
    assert (per_token == model_bytes) if kv_dtype == "model" else (per_token < model_bytes / 1.5)
    if kv_dtype == "model":  # transformers' own pages: the tokens of generate with a DynamicCache
        for rid, o in out.items():
            i = int(rid.split("_")[1])
            ref = model.generate(torch.tensor([prompts[i]]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
            assert o.generated_tokens == ref[0, len(prompts[i]) :].tolist()
