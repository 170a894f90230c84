"""hf_kvcache.stores.opaque_widen: per-token half-precision FP8 scales reach compiled CPU code through the opaque
widening op (so inductor's dequantization kernel sees float32 inputs only), eager code never pays for it, and the
op computes exactly `.float()`."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.stores.opaque_widen import scales_to_float32, widen_to_float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widen_equals_float(dtype):
    x = (torch.randn(2, 3, 17, 1) * 1e3).to(dtype)
    assert widen_to_float32(x).dtype == torch.float32
    assert torch.equal(widen_to_float32(x), x.float())
    assert torch.equal(torch.compile(scales_to_float32, fullgraph=True)(x), x.float())


def test_eager_reads_do_not_use_the_opaque_op(monkeypatch):
    calls = []
    monkeypatch.setattr("hf_kvcache.stores.opaque_widen.widen_to_float32", lambda x: calls.append(1) or x.float())
    x = torch.randn(4, 1).to(torch.bfloat16)
    assert torch.equal(scales_to_float32(x), x.float()) and not calls


def test_compiled_fp8_per_token_decode_widens_scales_opaquely():
    """The graph dynamo hands to the backend for a compiled FP8 per-token decode step contains the opaque op."""
    torch._dynamo.reset()
    model = build_model("llama", num_hidden_layers=2)
    hf_kvcache.enable(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    cache = hf_kvcache.QuantizedFP8Cache(model, max_length=16)
    forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    with torch.no_grad():
        model(input_ids=random_ids(1, 8), **cache_kwargs(cache))
        for step in range(3):
            forward(
                input_ids=random_ids(1, 1, seed=step), position_ids=torch.full((1, 1), 8 + step), **cache_kwargs(cache)
            )
    assert graphs and all("widen_to_float32" in g for g in graphs)
