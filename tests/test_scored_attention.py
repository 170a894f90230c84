"""hf_kvcache.attention.scored: output and column scores from one pass equal eager attention with the layer's
validity mask (GQA, padding columns, causal tail, softcap, sinks, query weights, scored suffix, any chunk size), its
memory stays O(chunk x kv), and H2O through the bridge (sdpa and eager models) equals the two-pass reference."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_pad, random_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hf_kvcache
import hf_kvcache.attention.bridge as bridge
from hf_kvcache import cache_kwargs
from hf_kvcache.attention.bridge import build_validity_mask
from hf_kvcache.attention.scored import scored_attention


def reference(query, key, value, valid, causal_tail, scaling, softcap=None, sinks=None, weight=None, score_from=0):
    """Eager attention in float64 over the whole [q, kv] mask: (output [B, q, Hq, Dv], column scores [B, Hq, kv])."""
    batch, q_heads, q, _ = query.shape
    groups = q_heads // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    logits = query.double() @ k.transpose(-1, -2) * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if valid is None:
        valid = torch.ones(batch, 1, key.shape[2], dtype=torch.bool)
    logits = logits.masked_fill(~build_validity_mask(valid, causal_tail, query), float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, q_heads, 1, 1).expand(batch, q_heads, q, 1)
        probs = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    probs = torch.nan_to_num(probs)  # rows with nothing visible (decode, every column invalid): zero
    out = (probs @ v).transpose(1, 2)
    w = torch.ones(batch, q, dtype=torch.float64) if weight is None else weight.double()
    w[:, :score_from] = 0
    return out, (probs * w[:, None, :, None]).sum(2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 3]),
    q=st.integers(1, 13),
    past=st.integers(0, 11),
    chunk=st.sampled_from([None, 1, 3, 5, 64]),
    per_head=st.booleans(),
    holes=st.booleans(),
    causal=st.booleans(),
    softcap=st.sampled_from([None, 5.0]),
    with_sinks=st.booleans(),
    weighted=st.booleans(),
    score_from=st.integers(0, 13),
    seed=st.integers(0, 2**16),
)
def test_equals_eager_reference(
    batch, kv_heads, groups, q, past, chunk, per_head, holes, causal, softcap, with_sinks, weighted, score_from, seed
):
    g = torch.Generator().manual_seed(seed)
    q_heads, kv, dim = kv_heads * groups, past + q, 8
    query = torch.randn(batch, q_heads, q, dim, generator=g) * 2
    key = torch.randn(batch, kv_heads, kv, dim, generator=g) * 2
    value = torch.randn(batch, kv_heads, kv, 6, generator=g)  # Dv != Dk
    valid = None
    if holes:
        valid = torch.rand(batch, kv_heads if per_head else 1, kv, generator=g) > 0.3
    causal_tail = q if causal and q > 1 else 0
    sinks = torch.randn(q_heads, generator=g) if with_sinks else None
    weight = (torch.rand(batch, q, generator=g) > 0.3).float() if weighted else None
    score_from = min(score_from, q)
    out, scores = scored_attention(
        query,
        key,
        value,
        valid,
        causal_tail,
        0.3,
        softcap=softcap,
        sinks=sinks,
        query_weight=weight,
        score_from=score_from,
        chunk=chunk,
    )
    ref_out, ref_scores = reference(query, key, value, valid, causal_tail, 0.3, softcap, sinks, weight, score_from)
    assert out.shape == (batch, q, q_heads, 6) and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.double(), ref_scores, atol=1e-5, rtol=1e-5)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_memory_is_chunk_by_kv_never_the_whole_prompt():
    batch, q_heads, kv_heads, q, dim, chunk = 1, 4, 2, 512, 16, 32
    query, key, value = (
        torch.randn(batch, q_heads, q, dim),
        torch.randn(batch, kv_heads, q, dim),
        torch.randn(batch, kv_heads, q, dim),
    )
    valid = torch.ones(batch, kv_heads, q, dtype=torch.bool)
    with _LargestTensor() as mode:
        scored_attention(query, key, value, valid, q, 0.25, chunk=chunk)
    assert mode.largest <= batch * q_heads * chunk * q  # one chunk's logits, never [q, kv] per head
    assert mode.largest < batch * q_heads * q * q // 4


def test_bad_arguments_name_the_parameter():
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="causal_tail"):
        scored_attention(query, key, key, None, 2, 1.0)
    with pytest.raises(ValueError, match="valid"):
        scored_attention(query, key, key, torch.ones(1, 3, 5, dtype=torch.bool), 3, 1.0)
    with pytest.raises(ValueError, match="query heads"):
        scored_attention(torch.randn(1, 3, 3, 8), key, key, None, 3, 1.0)
    with pytest.raises(ValueError, match="chunk"):
        scored_attention(query, key, key, None, 3, 1.0, chunk=0)
    with pytest.raises(ValueError, match="score_from"):
        scored_attention(query, key, key, None, 3, 1.0, score_from=4)
    with pytest.raises(ValueError, match="query_weight"):
        scored_attention(query, key, key, None, 3, 1.0, query_weight=torch.ones(1, 5))


def _h2o_run(model, ids, mask, prefill, output_attentions):
    """Logits of a padded prefill + one-token steps through H2O, and the final scores of every layer."""
    cache = hf_kvcache.H2OCache(model, heavy=5, recent=4)
    kwargs = {"output_attentions": True} if output_attentions else {}
    logits = [
        model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], **cache_kwargs(cache), **kwargs).logits[
            :, -1
        ]
    ]
    for i in range(prefill, ids.shape[1]):
        logits.append(
            model(input_ids=ids[:, i : i + 1], attention_mask=mask[:, : i + 1], **cache_kwargs(cache), **kwargs).logits[
                :, -1
            ]
        )
    return torch.stack(logits, 1), [layer.policy.scores.clone() for layer in cache.layers], cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_h2o_one_pass_equals_the_eager_two_pass_path(arch, monkeypatch):
    """The eager model with output_attentions runs eager attention plus the second-pass scores (the reference);
    without it, and on the sdpa model, output and scores come from scored_attention. Padded batch, eviction."""
    calls = []
    original = bridge.scored_attention
    monkeypatch.setattr(bridge, "scored_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    rows = [random_ids(1, 23, seed=1)[0], random_ids(1, 17, seed=2)[0]]
    ids, mask = left_pad(rows)
    eager = build_model(arch, attn="eager")
    sdpa = build_model(arch, attn="sdpa")
    with torch.no_grad():
        ref_logits, ref_scores, _ = _h2o_run(eager, ids, mask, 15, output_attentions=True)
        assert not calls  # the reference never went through the one-pass path
        for model in (eager, sdpa):
            logits, scores, _ = _h2o_run(model, ids, mask, 15, output_attentions=False)
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
            for got, ref in zip(scores, ref_scores):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert len(calls) == 2 * eager.config.num_hidden_layers * (1 + ids.shape[1] - 15)  # 2 models, every forward
