"""hf_kvcache.attention.gqa_decode: one decode token's query heads packed by KV group equal the repeated-K/V attention
transformers runs under torch.compile, the bridge takes the packed path for our layers in decode (eager and
compiled), and the cases packing cannot reproduce fall back."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from transformers.integrations.sdpa_attention import repeat_kv

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.attention import gqa_decode
from hf_kvcache.attention.gqa_decode import packed_decode_attention
from hf_kvcache.layers import codes_read


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def _reference(query, key, value, mask, groups):
    """transformers' compiled decode: K/V repeated per query head, the mask broadcast (or repeated) alike."""
    if mask is not None and mask.shape[1] not in (1, query.shape[1]):
        mask = mask.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.125
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask_heads", [None, 1, "kv"])
@pytest.mark.parametrize("kv_heads,groups", [(2, 2), (3, 3), (1, 4)])
def test_packed_equals_repeated(mask_heads, kv_heads, groups):
    torch.manual_seed(0)
    batch, kv, dim = 2, 37, 16
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(2, batch, kv_heads, kv, dim).unbind(0)
    mask = None
    if mask_heads is not None:
        mask = torch.rand(batch, kv_heads if mask_heads == "kv" else 1, 1, kv) > 0.3
        mask[..., -1] = True
    out, weights = packed_decode_attention(_Module(groups), query, key, value, mask, {"scaling": 0.125})
    assert weights is None and out.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(out, _reference(query, key, value, mask, groups), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case", ["prefill", "mha", "mask_per_query_head", "softcap", "position_bias", "sinks", "dropout_training"]
)
def test_packing_declines(case):
    batch, kv_heads, groups, kv, dim = 1, 2, 2, 8, 16
    module = _Module(groups)
    q_len, q_heads, mask, kwargs = 1, kv_heads * groups, None, {"scaling": 0.25}
    if case == "prefill":
        q_len = 3
    elif case == "mha":
        q_heads = kv_heads
    elif case == "mask_per_query_head":
        mask = torch.ones(batch, q_heads, 1, kv, dtype=torch.bool)
    elif case == "softcap":
        kwargs["softcap"] = 30.0
    elif case == "position_bias":
        kwargs["position_bias"] = torch.zeros(1, q_heads, 1, kv)
    elif case == "sinks":
        module.sinks = torch.zeros(q_heads)
    elif case == "dropout_training":
        module.train()
        kwargs["dropout"] = 0.1
    query = torch.randn(batch, q_heads, q_len, dim)
    key, value = torch.randn(2, batch, kv_heads, kv, dim).unbind(0)
    assert packed_decode_attention(module, query, key, value, mask, kwargs) is None


def _decode_logits(model, cache, ids, mask, steps):
    out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    logits = [out.logits[:, -1]]
    for _i in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        out = model(input_ids=token, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda m: hf_kvcache.SinkCache(m, sinks=2, budget=12),
        lambda m: hf_kvcache.QuantizedFP8Cache(m, attention="dequantize"),  # ("auto" decodes from the codes on CPU)
        lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4),
    ],
    ids=["sink", "fp8", "h2o"],
)
def test_bridge_decodes_packed_and_matches_unpacked(monkeypatch, make_cache):
    """A GQA model (4 query / 2 KV heads), left-padded batch: decode runs through the packed path (counted) and
    gives the logits of the same run with packing switched off (the model's own sdpa, K/V repeated or packed by
    transformers)."""
    model = build_model("llama")
    hf_kvcache.enable(model)
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    # (on CPU the sink cache's float32 decode steps read through the native kernel instead, tested in
    # test_blockwise_integration; the packed SDPA path is what they take on a GPU, in bfloat16 and compiled)
    monkeypatch.setattr(codes_read, "full_precision_native", lambda layer, device: False)
    calls = []
    original = gqa_decode.packed_decode_attention

    def counting(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(hf_kvcache.attention.bridge, "packed_decode_attention", counting)
    with torch.no_grad():
        packed = _decode_logits(model, make_cache(model), ids, mask, steps=6)
    taken = sum(calls)
    monkeypatch.setattr(hf_kvcache.attention.bridge, "packed_decode_attention", lambda *a, **k: None)
    with torch.no_grad():
        unpacked = _decode_logits(model, make_cache(model), ids, mask, steps=6)
    layers = model.config.num_hidden_layers
    if isinstance(make_cache(model), hf_kvcache.H2OCache):
        assert taken == 0  # H2O decode scores attention in one pass (hf_kvcache.attention.scored) instead
    else:
        assert taken == 6 * layers
    torch.testing.assert_close(packed, unpacked, rtol=1e-4, atol=1e-4)
