"""ForwardInfo.for_layer: a compressed layer updated outside a forward the bridge announced, or twice in one forward,
or with another token count than announced, raises naming what to do; an announced forward serves each layer once."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model

import hf_kvcache


def test_updates_outside_an_announced_forward_raise():
    model = build_model("llama")
    cache = hf_kvcache.SinkCache(model, sinks=2, window=8)
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    keys = torch.randn(1, heads, 3, dim)
    with pytest.raises(RuntimeError, match=r"updated outside a forward announced.*hf_kvcache.enable"):
        cache.update(keys, keys, 0)
    cache.begin_forward(3, 1, "cpu", None, None)
    with pytest.raises(RuntimeError, match="Layer 0 got 2 new tokens but the forward announced 3"):
        cache.update(keys[:, :, :2], keys[:, :, :2], 0)
    cache.update(keys, keys, 0)
    with pytest.raises(RuntimeError, match="updated outside a forward announced"):  # the same layer twice
        cache.update(keys, keys, 0)
    cache.update(keys, keys, 1)  # another layer of the same forward
    assert cache.layers[0].forward_info is cache.layers[1].forward_info
