"""One scoring contract for both paths (hf_kvcache/scorers/base.py): a scorer's `score(Prompt)`, which serving's
`kv_compress` ranks by, keeps per KV head exactly the tokens its hooks keep in `generate`'s prompt mode
(`compress="prompt"`, one prefill forward), on the same prompt of a tiny Llama: the two paths score a prompt the
same way."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_kvcache import KeyDiffCache, KnormCache, SnapKVCache
from hf_kvcache.integration.attention_inputs import capture_attention_inputs
from hf_kvcache.integration.cache_argument import cache_kwargs
from hf_kvcache.scorers.base import Prompt
from hf_kvcache.scorers.registry import make_scorer

LENGTH, BUDGET = 40, 12
CASES = [
    ("knorm", KnormCache, {}),
    ("keydiff", KeyDiffCache, {}),
    ("snapkv", SnapKVCache, {"window": 4, "kernel": 3}),
]


def _kept_by_generate(model, ids, cache_cls, options) -> list[list[set[int]]]:
    """Per layer and KV head, the positions prompt mode keeps after the prompt's one forward."""
    cache = cache_cls(model, budget=BUDGET, compress="prompt", **options)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    kept = []
    for layer in cache.compressed_layers:
        valid, positions = layer.slot_valid[0, :, :-1], layer.head_positions()[0, :, :-1]
        kept.append([set(positions[h][valid[h]].tolist()) for h in range(valid.shape[0])])
    return kept


def _kept_by_score(model, ids, name, options) -> list[list[set[int]]]:
    """Per layer and KV head, the BUDGET positions `score` ranks best (SnapKV: its window and the best others)."""
    hidden, cache = {}, DynamicCache()
    with torch.no_grad(), capture_attention_inputs(model, lambda i, h: hidden.__setitem__(i, h.clone())):
        model(ids, **cache_kwargs(cache), use_cache=True)
    cos, sin = model.model.rotary_emb(hidden[0], torch.arange(LENGTH)[None])
    scorer = make_scorer(name, **options)
    window = options.get("window", 0)
    kept = []
    for i, layer in enumerate(cache.layers):
        fields = {"keys": layer.keys[0]}
        if "queries" in scorer.prompt_reads:
            attention = model.model.layers[i].self_attn
            query = attention.q_proj(hidden[i]).view(1, LENGTH, -1, attention.head_dim).transpose(1, 2)
            query, _ = apply_rotary_pos_emb(query, query, cos, sin)
            fields.update(queries=query[0, :, -window:].detach(), scaling=attention.scaling)
        with torch.no_grad():
            scores = scorer.score(Prompt(**fields))  # [Hkv, P]
        rows = []
        for head_scores in scores:
            best = head_scores[: LENGTH - window].topk(BUDGET - window).indices.tolist()
            rows.append(set(best) | set(range(LENGTH - window, LENGTH)))
        kept.append(rows)
    return kept


@pytest.mark.parametrize("name, cache_cls, options", CASES, ids=[c[0] for c in CASES])
def test_score_keeps_what_prompt_mode_keeps(name, cache_cls, options):
    model = build_model("llama")
    ids = random_ids(1, LENGTH, seed=5)
    by_generate = _kept_by_generate(model, ids, cache_cls, options)
    by_score = _kept_by_score(model, ids, name, options)
    assert all(len(head) == BUDGET for layer in by_generate for head in layer)
    assert by_score == by_generate
    assert any(len({frozenset(h) for h in layer}) > 1 for layer in by_score)  # heads choose differently: per head
