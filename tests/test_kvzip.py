"""KVzip (hf_kvcache.caches.kvzip, hf_kvcache.policies.kvzip): context-reconstruction scores, checked against an
independent reference built from eager attention weights of plain forwards, and the cache's life around them."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from conftest import build_model, left_pad, random_ids
from test_generation_modes import tiny_chat_tokenizer
from transformers import DynamicCache

from hf_kvcache import KVzipCache, cache_kwargs
from hf_kvcache.attention.scored import scored_attention
from hf_kvcache.caches.kvzip_request import FIRST_REQUEST, NEXT_REQUEST, PREVIOUS_TAIL, request_ids_from_tokenizer
from hf_kvcache.policies.kvzip import layer_budgets

# the reconstruction runs nested forwards of the base model with the cache argument transformers names (`cache` /
# `past_key_values`): run at both ends of the supported range
pytestmark = pytest.mark.upstream

REQUEST = {"first": [5, 6, 7], "next": [8, 9], "suffix": [10]}
UNIFORM = {"head_budget": "uniform", "layer_budget": "uniform"}  # per KV head and layer (the reference's budget)


def reference_scores(model, ids: torch.Tensor, chunk: int, sinks: int) -> torch.Tensor:
    """[layers, Hkv, L] KVzip scores of one row from eager attention weights (no cache): per chunk, the context
    followed by its request and the chunk; each query's weights renormalised over sinks + chunk + request; max over
    the queries and the KV group's query heads."""
    config = model.config
    kv_heads, length = config.num_key_value_heads, ids.shape[1]
    groups = config.num_attention_heads // kv_heads
    scores = torch.zeros(config.num_hidden_layers, kv_heads, length)
    row = ids[0].tolist()
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        request = REQUEST["first"] if start == 0 else REQUEST["next"] + row[max(0, start - PREVIOUS_TAIL) : start]
        repeat = torch.tensor([request + REQUEST["suffix"] + row[start:end]])
        with torch.no_grad():
            attentions = model(torch.cat((ids, repeat), 1), output_attentions=True).attentions
        columns = torch.zeros(length + repeat.shape[1], dtype=torch.bool)
        columns[:sinks], columns[start:end], columns[length:] = True, True, True
        for index, weights in enumerate(attentions):
            rows = weights[0, :, length:]  # [Hq, r, L + r]
            rows = rows / (rows * columns).sum(-1, keepdim=True)
            best = rows.amax(1)[:, :length].view(kv_heads, groups, length).amax(1)
            scores[index, :, start:end] = best[:, start:end]
    return scores


def kept_positions(cache, row: int = 0, first: int | None = None) -> list[list[list[int]]]:
    """Per layer and head, the sorted position ids kept among the first `first` slots (the placed context)."""
    out = []
    for layer in cache.layers:
        valid, positions = layer.slot_valid[row, :, :first], layer.head_positions()[row, :, :first]
        out.append([sorted(positions[h][valid[h]].tolist()) for h in range(valid.shape[0])])
    return out


@pytest.mark.parametrize("chunk", [64, 7])
def test_kept_tokens_are_the_reference_top_budget(chunk):
    """One chunk (the whole context) and several (restricted softmax, requests that quote the previous chunk)."""
    model = build_model("llama", attn="eager")
    ids, budget, sinks = random_ids(1, 20, seed=3), 6, 2
    reference = reference_scores(model, ids, chunk, sinks)
    reference[..., :sinks] = float("inf")
    cache = KVzipCache(model, budget=budget, sinks=sinks, chunk_size=chunk, request_ids=REQUEST, **UNIFORM)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        cache.compress_context(model)
    want = [[sorted(head.topk(budget).indices.tolist()) for head in layer] for layer in reference]
    assert kept_positions(cache) == want
    assert cache.get_seq_length() == 20


def test_the_bridge_max_reduction_with_a_restricted_softmax():
    """scored_attention(reduce="max", normalize_over=...) against the formula, with padding queries weighted out."""
    g = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(2, 4, 5, 8, generator=g),
        torch.randn(2, 2, 9, 8, generator=g),
        torch.randn(2, 2, 9, 8, generator=g),
    )
    columns = torch.rand(2, 9, generator=g) > 0.3
    columns[:, -5:] = True
    weight = torch.ones(2, 5)
    weight[1, :2] = 0
    _, scores = scored_attention(
        query, key, value, None, 5, 0.35, query_weight=weight, reduce="max", normalize_over=columns, chunk=2
    )
    logits = query.view(2, 2, 2, 5, 8) @ key[:, :, None].transpose(-1, -2) * 0.35
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    probs = probs / (probs * columns[:, None, None, None]).sum(-1, keepdim=True) * weight[:, None, None, :, None]
    torch.testing.assert_close(scores, probs.amax(3).reshape(2, 4, 9))
    with pytest.raises(ValueError, match="`reduce` must be one of"):
        scored_attention(query, key, value, None, 5, 0.35, reduce="mean")


def test_left_padded_rows_keep_and_generate_as_alone():
    model = build_model("llama")
    rows = [random_ids(1, n, seed=20 + n)[0] for n in (18, 11)]
    ids, mask = left_pad(rows)
    batch = KVzipCache(model, budget=6, chunk_size=5, request_ids=REQUEST, **UNIFORM)
    together = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **cache_kwargs(batch))
    for b, row in enumerate(rows):
        alone = KVzipCache(model, budget=6, chunk_size=5, request_ids=REQUEST, **UNIFORM)
        single = model.generate(row[None], max_new_tokens=5, do_sample=False, **cache_kwargs(alone))
        assert together[b, ids.shape[1] :].tolist() == single[0, row.numel() :].tolist()
        pad = ids.shape[1] - row.numel()
        assert kept_positions(batch, b, 6) == kept_positions(alone, 0, 6)  # (positions count real tokens only)
        assert pad >= 0


@pytest.mark.parametrize("arch", ["gemma2", "cohere2", "llama"])
def test_a_budget_that_keeps_everything_equals_the_full_cache(arch):
    """The reconstruction's tokens leave no trace: its request is cropped from the scoring layers and the other
    layers (sliding windows) are restored, so at a budget of the whole prompt greedy generation equals
    DynamicCache's with the same step logits."""
    model = model_zoo.ZOO[arch]()
    ids = random_ids(1, 14, seed=4)
    want = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **cache_kwargs(DynamicCache(config=model.config)),
    )
    cache = KVzipCache(model, budget=14, chunk_size=6, request_ids=REQUEST, **UNIFORM)
    got = model.generate(
        ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache)
    )
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 14 + 5


def test_head_adaptive_layers_hold_their_budget_and_free_the_context():
    model = build_model("llama")
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    ids = random_ids(2, 30, seed=5)
    cache = KVzipCache(model, budget=8, head_budget="adaptive", layer_budget="uniform", request_ids=REQUEST)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        full = cache.nbytes()
        cache.compress_context(model)
    for layer in cache.layers:
        counts = layer.slot_valid[..., : layer.used].sum(-1)
        assert counts.sum(-1).tolist() == [8 * heads] * 2  # the layer's total, however split
        assert (counts >= int(8 * 0.2)).all()
        assert layer.store.keys.shape[1] == 1  # one pool
        assert layer.store.keys.shape[2] == 8 * heads + 1  # the budget (and the trash slot), not the context
    assert cache.nbytes() < full / 2  # the full-precision context is gone
    splits = [tuple(row) for layer in cache.layers for row in layer.slot_valid[..., : layer.used].sum(-1).tolist()]
    assert any(len(set(split)) > 1 for split in splits)  # heads do get different shares
    itemsize = cache.layers[0].store.keys.element_size()
    assert cache.layers[0].store.nbytes() == cache.layers[0].store.keys.shape[2] * 2 * 2 * head_dim * itemsize


def test_end_prompt_appends_the_question_uncompressed():
    """kvpress's protocol: compress the document, then append the question uncompressed."""
    model = build_model("llama")
    document, question = random_ids(1, 24, seed=6), random_ids(1, 5, seed=7)
    cache = KVzipCache(model, budget=6, request_ids=REQUEST, **UNIFORM)
    with torch.no_grad():
        model(document, **cache_kwargs(cache))
        cache.end_prompt()
        model(question, **cache_kwargs(cache))  # compresses first, then appends the 5 tokens
    layer = cache.layers[0]
    assert cache.get_seq_length() == 29
    assert layer.slot_valid[0, :, : layer.used].sum(-1).tolist() == [11] * model.config.num_key_value_heads
    assert sorted(layer.head_positions()[0, 0, 6:11].tolist()) == list(range(24, 29))


def test_reset_collects_a_new_context():
    model = build_model("llama")
    cache = KVzipCache(model, budget=6, request_ids=REQUEST)
    first, second = random_ids(1, 16, seed=8), random_ids(1, 19, seed=9)
    model.generate(first, max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
    cache.reset()
    again = model.generate(second, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
    fresh = model.generate(
        second, max_new_tokens=4, do_sample=False, **cache_kwargs(KVzipCache(model, budget=6, request_ids=REQUEST))
    )
    assert again.tolist() == fresh.tolist()


def test_cache_implementation_name_and_the_tokenizer_request():
    model = build_model("llama")
    tokenizer = tiny_chat_tokenizer()
    requests = request_ids_from_tokenizer(tokenizer)
    assert tokenizer.decode(requests["first"]) == FIRST_REQUEST
    assert tokenizer.decode(requests["next"]) == NEXT_REQUEST
    assert tokenizer.decode(requests["suffix"]) == "<|im_end|>\n<|im_start|>assistant\n"  # the assistant's turn
    ids = random_ids(1, 16, seed=10)
    by_name = model.generate(
        ids,
        max_new_tokens=4,
        do_sample=False,
        cache_implementation="kvzip",
        cache_config={"budget": 0.5, "request_ids": requests},
    )
    direct = model.generate(
        ids, max_new_tokens=4, do_sample=False, **cache_kwargs(KVzipCache(model, budget=0.5, tokenizer=tokenizer))
    )
    assert by_name.tolist() == direct.tolist()


def test_bad_input_names_the_parameter():
    model = build_model("llama")
    with pytest.raises(ValueError, match=r"`compress` must be one of \('prompt',\)"):
        KVzipCache(model, budget=4, compress="always")
    with pytest.raises(ValueError, match="`request_ids` must be a dict with the keys"):
        KVzipCache(model, budget=4, request_ids={"first": [1]})
    with pytest.raises(ValueError, match=r"`request_ids\['next'\]` must be a list of token ids"):
        KVzipCache(model, budget=4, request_ids={**REQUEST, "next": "repeat"})
    with pytest.raises(ValueError, match="`chunk_size` must be an integer >= 1"):
        KVzipCache(model, budget=4, chunk_size=0, request_ids=REQUEST)
    with pytest.raises(ValueError, match="`tokenizer` must be a name or path"):
        KVzipCache(model, budget=4, tokenizer=3)
    ids = random_ids(1, 10, seed=1)
    cache = KVzipCache(model, budget=4)  # no tokenizer: the random model's name_or_path is empty
    with pytest.raises(ValueError, match="needs a tokenizer for its reconstruction request and the model has no"):
        model(ids, **cache_kwargs(cache))
    cache = KVzipCache(model, budget=4, request_ids={**REQUEST, "suffix": [10_000]})
    with pytest.raises(ValueError, match=r"`request_ids`: token ids \[10000\] are outside the model's vocabulary"):
        model(ids, **cache_kwargs(cache))
    cache = KVzipCache(model, budget=4, request_ids=REQUEST)
    with pytest.raises(ValueError, match="`input_ids`, not `inputs_embeds`"):
        model(inputs_embeds=model.get_input_embeddings()(ids), **cache_kwargs(cache))


def test_layer_budgets_are_the_model_wide_top():
    """One row: each layer's share is exactly how many of the model's best (head, token) pairs it holds."""
    g = torch.Generator().manual_seed(1)
    scores = [torch.rand(1, 2, 10, generator=g) * scale for scale in (1.0, 1.5, 0.8)]
    shares = layer_budgets(scores, [4, 4, 4], heads=2)
    flat = torch.cat([s.flatten() for s in scores])
    top = flat.topk(24).indices
    counts = [int(((top >= 20 * i) & (top < 20 * (i + 1))).sum()) for i in range(3)]
    assert min(counts) >= 2  # (so the one-token-per-head minimum does not apply)
    assert shares == counts and sum(shares) == 24
    assert shares[1] > shares[0] > shares[2]
    scores[2] = scores[2] * 0.01  # a layer no pair of the model's top is in: one token per head, from the largest
    shares = layer_budgets(scores, [4, 4, 4], heads=2)
    assert shares[2] == 2 and sum(shares) == 24


@pytest.mark.parametrize("head_budget", ["adaptive", "uniform"])
def test_layer_adaptive_budgets_hold_the_models_budget(head_budget):
    model = build_model("llama")
    heads = model.config.num_key_value_heads
    cache = KVzipCache(
        model, budget=8, head_budget=head_budget, layer_budget="adaptive", safeguard=0.0, request_ids=REQUEST
    )
    ids = random_ids(1, 30, seed=5)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        cache.compress_context(model)
    held = [int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers]
    assert len(set(held)) > 1  # layers get different shares
    if head_budget == "adaptive":  # exactly the model's budget, each pool its layer's share
        assert sum(held) == 8 * heads * len(cache.layers)
        assert [layer.store.keys.shape[2] - 1 for layer in cache.layers] == held
    else:  # a uniform layer keeps its share's per-head average
        assert sum(held) <= 8 * heads * len(cache.layers)
    out = model.generate(
        ids,
        max_new_tokens=3,
        do_sample=False,
        **cache_kwargs(
            KVzipCache(model, budget=8, head_budget=head_budget, layer_budget="adaptive", request_ids=REQUEST)
        ),
    )
    assert out.shape[1] == 33


def test_a_context_not_yet_compressed_cannot_be_saved(tmp_path):
    from hf_kvcache import save_cache_state

    model = build_model("llama")
    cache = KVzipCache(model, budget=4, request_ids=REQUEST)
    with torch.no_grad():
        model(random_ids(1, 10, seed=2), **cache_kwargs(cache))
    with pytest.raises(ValueError, match="has not compressed yet"):
        save_cache_state(cache, tmp_path / "state.safetensors")


def test_per_layer_settings_and_kept_layers():
    """`layers`: a layer's own budget is used when it is placed; a "keep" layer (not scored) comes back from the
    reconstruction exactly as it was, holding the whole prompt."""
    model = build_model("llama")
    cache = KVzipCache(model, budget=6, request_ids=REQUEST, layers={0: "keep", 1: {"budget": 4}})
    ids = random_ids(1, 18, seed=12)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        kept_keys = cache.layers[0].store.read(18)[0].clone()
        cache.compress_context(model)
    assert cache.layers[0].seen == 18 and cache.layers[0].used == 18
    assert torch.equal(cache.layers[0].store.read(18)[0], kept_keys)
    assert cache.layers[1].slot_valid[..., : cache.layers[1].used].sum(-1).tolist() == [[4, 4]]


def test_generate_modes_beam_chunked_prefill_and_assisted():
    model = build_model("llama")
    ids = random_ids(2, 20, seed=5)

    def run(**kwargs):
        return model.generate(
            ids, max_new_tokens=4, **kwargs, **cache_kwargs(KVzipCache(model, budget=6, request_ids=REQUEST))
        )

    assert torch.equal(run(do_sample=False), run(do_sample=False, prefill_chunk_size=7))  # one context either way
    assert run(num_beams=2, do_sample=False).shape == (2, 24)
    with pytest.raises(ValueError, match="cannot crop the context it is collecting"):
        model.generate(
            ids[:1],
            max_new_tokens=4,
            do_sample=False,
            assistant_model=build_model("llama", seed=1),
            **cache_kwargs(KVzipCache(model, budget=6, request_ids=REQUEST)),
        )


@pytest.mark.parametrize("head_budget", ["adaptive", "uniform"])
@pytest.mark.parametrize("precision", ["fp8_e4m3", "int8"])
def test_quantized_placement_keeps_the_same_tokens_in_fewer_bytes(precision, head_budget):
    """KVzip's placement at a quantized precision: the same (head, token) pairs as in full precision (the scores
    come from the full-precision context), each stored as codes; the bytes held shrink, the logits stay close."""
    model = build_model("llama")
    ids = random_ids(2, 30, seed=5)
    settings = dict(budget=8, head_budget=head_budget, layer_budget="uniform", request_ids=REQUEST)
    full, quantized = KVzipCache(model, **settings), KVzipCache(model, precision=precision, **settings)
    with torch.no_grad():
        for cache in (full, quantized):
            model(ids, **cache_kwargs(cache))
            cache.compress_context(model)
    for a, b in zip(full.layers, quantized.layers):
        assert torch.equal(a.slot_valid, b.slot_valid)  # the same tokens kept, in the same slots
        assert type(b.store).__name__ != type(a.store).__name__
    assert quantized.nbytes() < 0.75 * full.nbytes()
    step = random_ids(2, 1, seed=6)
    with torch.no_grad():
        want = model(step, **cache_kwargs(full)).logits
        got = model(step, **cache_kwargs(quantized)).logits
    assert not torch.equal(got, want)  # really quantized
    assert (got - want).norm() < 0.1 * want.norm()  # (FP8 on a random tiny model: about 5%)


def test_precision_must_be_a_per_token_format():
    model = build_model("llama")
    with pytest.raises(ValueError, match="precision"):
        KVzipCache(model, budget=8, precision="fp7", request_ids=REQUEST)
    with pytest.raises(ValueError, match="precision.*token"):
        KVzipCache(model, budget=8, precision={"format": "int4", "granularity": "channel"}, request_ids=REQUEST)


def test_default_allotment_is_model_wide():
    """`kvzip` with only a budget allots it over the whole model (docs/defaults.md): layers get different shares."""
    model = build_model("llama")
    cache = KVzipCache(model, budget=8, request_ids=REQUEST)
    assert (cache.head_budget, cache.layer_budget) == ("adaptive", "adaptive")
    with torch.no_grad():
        model(random_ids(1, 30, seed=5), **cache_kwargs(cache))
        cache.compress_context(model)
    heads = model.config.num_key_value_heads
    kept = [int(layer.slot_valid[..., : layer.used].sum()) for layer in cache.layers]
    assert sum(kept) == 8 * heads * len(cache.layers)  # the model's budget
    assert len(set(kept)) > 1  # shared unevenly
