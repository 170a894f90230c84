"""Key rotation (hf_kvcache.common.rotation): keys stored rotated, queries rotated alike by the attention bridge."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from test_quantized_roundtrip import roundtrip
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import QuantizedFP8Cache, cache_kwargs
from hf_kvcache.common.rotation import hadamard_matrix, rotate, rotation_matrix
from hf_kvcache.sharing.calibration import calibrate, calibrated_scales
from hf_kvcache.stores.quantization import QuantSpec


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32


@pytest.mark.parametrize(
    "kind,dim", [("hadamard", 64), ("hadamard", 96), ("hadamard", 2), ("random", 96), ("random", 5)]
)
def test_rotations_are_orthogonal(kind, dim):
    r = rotation_matrix(kind, dim)
    torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-6, rtol=0)
    if kind == "random":
        assert torch.equal(r, rotation_matrix(kind, dim))  # seeded: the same matrix every time


def test_hadamard_spreads_every_channel_evenly():
    h = hadamard_matrix(64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full((64, 64), 1 / 8))
    blocks = rotation_matrix("hadamard", 96)  # three 32 x 32 blocks
    assert torch.equal(blocks[:32, :32], hadamard_matrix(32)) and not blocks[:32, 32:].any()
    assert rotation_matrix("none", 64) is None


def test_bad_rotation_names_the_parameter(llama):
    with pytest.raises(ValueError, match="key_rotation.*hadamard"):
        QuantizedFP8Cache(llama, key_rotation="walsh")
    with pytest.raises(ValueError, match="even head_dim.*random"):
        rotation_matrix("hadamard", 7)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(12)


def _fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return roundtrip(QuantSpec("fp8_e4m3", "token"), x)[0]


def test_rotation_shrinks_the_fp8_logit_error_of_outlier_channels():
    """The case rotation is for: queries and keys with their energy in the same few channels (RoPE models)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 512, 64, generator=g)
    query = torch.randn(64, 16, generator=g)
    keys[..., :4] *= 20
    query[:4] *= 20
    r = rotation_matrix("hadamard", 64)
    exact = keys @ query
    plain = _fp8_roundtrip(keys) @ query
    rotated = _fp8_roundtrip(keys @ r) @ (r.T @ query)  # (k R) . (q R) = k . q
    err_plain = (plain - exact).pow(2).mean()
    err_rotated = (rotated - exact).pow(2).mean()
    assert err_rotated < 0.25 * err_plain


def test_keys_are_returned_rotated_and_logits_unchanged(llama):
    ids = random_ids(1, 24, seed=4)
    cache = QuantizedFP8Cache(llama, key={"format": "none"}, value={"format": "none"}, key_rotation="hadamard")
    dynamic = DynamicCache(config=llama.config)
    with torch.no_grad():
        ours = llama(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits
        ref = llama(input_ids=ids, **cache_kwargs(dynamic), use_cache=True).logits
        keys, values = cache.layers[1].store.read(24)
    r = cache.rotation_matrix
    torch.testing.assert_close(keys, rotate(dynamic.layers[1].keys, r), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, dynamic.layers[1].values)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    assert cache.layers[0].key_rotation is cache.layers[1].key_rotation  # one matrix for the cache


def test_rotation_matrix_counted_once_in_nbytes(llama):
    ids = random_ids(1, 16, seed=5)
    caches = {kind: QuantizedFP8Cache(llama, key_rotation=kind) for kind in ("none", "hadamard")}
    with torch.no_grad():
        for cache in caches.values():
            llama(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    assert caches["hadamard"].nbytes() - caches["none"].nbytes() == 32 * 32 * 4


def test_rotated_keys_need_the_bridge():
    model = build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    cache = QuantizedFP8Cache(model)  # enables the bridge
    model.set_attn_implementation("sdpa")  # a user switches attention afterwards: queries would not be rotated
    with torch.no_grad(), pytest.raises(RuntimeError, match="key_rotation.*enable"):
        model(input_ids=random_ids(1, 8), **cache_kwargs(cache), use_cache=True)
    hf_kvcache.enable(model)
    with torch.no_grad():
        model(input_ids=random_ids(1, 8), **cache_kwargs(QuantizedFP8Cache(model)), use_cache=True)


def test_calibration_follows_the_rotation(llama):
    ids = random_ids(1, 32, seed=6)
    rotated = calibrate(llama, input_ids=ids, window=32, key_smoothing=False, key_rotation="hadamard")
    assert rotated["key_rotation"] == "hadamard"
    dynamic = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=ids, **cache_kwargs(dynamic))
    keys = rotate(dynamic.layers[0].keys, rotation_matrix("hadamard", 32))
    torch.testing.assert_close(torch.tensor(rotated["key_scale"][0]), keys.abs().amax(dim=(0, 2, 3)) / 448)
    QuantizedFP8Cache(llama, granularity="head", key_smoothing=False, scales=rotated)
    plain = calibrate(llama, input_ids=ids, window=32, key_smoothing=False, key_rotation="none")
    with pytest.raises(ValueError, match="key_rotation='none'.*key_rotation='hadamard'"):
        QuantizedFP8Cache(llama, granularity="head", key_smoothing=False, scales=plain)
    QuantizedFP8Cache(llama, granularity="head", key_smoothing=False, scales=plain, key_rotation="none")
    constant = calibrated_scales(llama, 1.0, key_rotation="random")
    QuantizedFP8Cache(llama, granularity="head", key_smoothing=False, scales=constant, key_rotation="random")


def test_generate_with_rotation_from_cache_config(llama):
    ids = random_ids(1, 12, seed=7)
    out = {}
    for rotation in ("none", "hadamard", "random"):
        out[rotation] = llama.generate(
            input_ids=ids,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="fp8",
            cache_config={"key_rotation": rotation, "residual": 64},
        )
    # everything in the full-precision residual: the rotation is exact up to float rounding
    assert torch.equal(out["none"], out["hadamard"]) and torch.equal(out["none"], out["random"])


@pytest.mark.parametrize("arch,attn", [("llama", "eager"), ("qwen3", "sdpa"), ("phi3", "sdpa"), ("mistral", "eager")])
def test_rotation_is_exact_across_architectures_and_attention_functions(arch, attn):
    """Keys rotated in the cache, queries in the bridge: the same logits as DynamicCache (nothing quantized)."""
    model = build_model(arch, attn=attn)
    ids = random_ids(1, 20, seed=9)
    cache = QuantizedFP8Cache(model, residual=64, key_rotation="hadamard")
    assert cache.rotation_matrix is not None
    with torch.no_grad():
        ours = [model(input_ids=ids[:, :12], **cache_kwargs(cache), use_cache=True).logits[:, -1]]
        ref_cache = DynamicCache(config=model.config)
        ref = [model(input_ids=ids[:, :12], **cache_kwargs(ref_cache), use_cache=True).logits[:, -1]]
        for t in range(12, 20):
            ours.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
            ref.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(ref_cache), use_cache=True).logits[:, -1])
    torch.testing.assert_close(torch.stack(ours), torch.stack(ref), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotated_fp8_cache_in_half_precision_models(dtype):
    """Half-precision models: rotation is exact up to the dtype's rounding, and the quantized cache stays close."""
    model = build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2).to(dtype)
    ids = random_ids(1, 40, seed=10)

    def logprobs(cache):
        with torch.no_grad():
            out = [model(input_ids=ids[:, :24], **cache_kwargs(cache), use_cache=True).logits[:, -1]]
            for t in range(24, 40):
                out.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
        return torch.stack(out).float().log_softmax(-1)

    def kl(other):
        return float((ref.exp() * (ref - other)).sum(-1).mean())

    ref = logprobs(DynamicCache(config=model.config))
    # nothing quantized: rotation only, off by the dtype's rounding of rotated queries and keys (this random model's
    # logits are large: bfloat16 KL ~6e-4, float16 ~1e-5; FP8 itself costs ~4e-2 here, rotated or not)
    assert kl(logprobs(QuantizedFP8Cache(model, residual=64))) < 2e-3
    quantized = logprobs(QuantizedFP8Cache(model))
    assert torch.isfinite(quantized).all()
    assert kl(quantized) < 0.1
