"""Block-wise attention from quantized codes (hf_kvcache.kernels) against "dequantize everything, then softmax".

Codes come from our real codecs (FP8Codec / IntegerCodec through `from_codec`), so the adapters are checked too.
The Triton kernel runs under Triton's CPU interpreter in a subprocess (TRITON_INTERPRET must be set before triton
is imported). Peak extra memory is measured with a TorchDispatchMode that tracks the storages alive during the call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_kvcache.attention.bridge import build_validity_mask
from hf_kvcache.kernels import QuantizedKV, blockwise_attention, cpu_blockwise, dequantize
from hf_kvcache.stores.code_views import from_codec, store_segments
from hf_kvcache.stores.factory import make_codec
from hf_kvcache.stores.quantization import QuantSpec
from hf_kvcache.stores.quantized import QuantizedStore
from hf_kvcache.stores.workspace import TransientWorkspace

pytest.importorskip("optimum.quanto")
pytest.importorskip("hqq")


def codec_for(spec, x: torch.Tensor, pack_block: int | None = None):
    """A codec holding x [B, H, n, D] (written in one go)."""
    codec = make_codec(QuantSpec.from_value(spec))
    if pack_block is not None and hasattr(codec, "set_pack_block"):  # integer codecs: token-packed blocks
        codec.set_pack_block(pack_block)
    b, h, n, d = x.shape
    codec.allocate(b, h, d, n, torch.float32, "cpu")
    codec.put(codec.encode(x), 0)
    return codec


def quantized(spec, x, pack_block=None) -> QuantizedKV:
    return from_codec(codec_for(spec, x, pack_block), x.shape[2])


def dense_attention(query, ks, vs, valid, scaling, causal_tail=0, softcap=None, sinks=None, query_weight=None):
    """Dequantize everything, then float32 softmax attention (empty rows -> 0). Returns (output, column scores
    weighted by `query_weight` [B, q])."""
    ks = [ks] if isinstance(ks, QuantizedKV) else ks
    vs = [vs] if isinstance(vs, QuantizedKV) else vs
    k = torch.cat([dequantize(s) for s in ks], 2)
    v = torch.cat([dequantize(s) for s in vs], 2)
    b, hq, q, _ = query.shape
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = query.float() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if valid is not None or causal_tail:
        validity = valid if valid is not None else torch.ones(b, 1, k.shape[2], dtype=torch.bool)
        logits = logits.masked_fill(~build_validity_mask(validity, causal_tail, query), float("-inf"))
    if sinks is not None:
        logits = torch.cat((logits, sinks.float().view(1, hq, 1, 1).expand(b, hq, q, 1)), -1)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    weight = torch.ones(b, q) if query_weight is None else query_weight
    return probs @ v, (probs * weight[:, None, :, None]).sum(2)


FP8 = {"format": "fp8_e4m3"}
FP8_E5M2_G8 = {"format": "fp8_e5m2", "group_size": 8}
FP8_E8M0 = {"format": "fp8_e4m3", "scale_dtype": "e8m0"}
FP8_HEAD = {"format": "fp8_e4m3", "granularity": "head"}
FP8_TENSOR = {"format": "fp8_e4m3", "granularity": "tensor"}
FP8_CHANNEL = {"format": "fp8_e4m3", "granularity": "channel", "group_size": 16}
INT8 = {"format": "int8", "granularity": "token"}
INT4_KEYS = {"format": "int4", "granularity": "channel", "group_size": 16, "backend": "quanto"}  # KIVI keys
INT4_VALUES = {"format": "int4", "granularity": "token", "group_size": 8, "backend": "quanto"}  # KIVI values
INT2_HQQ = {"format": "int2", "granularity": "token", "group_size": 8, "backend": "hqq"}
KIVI_KEYS = {"format": "int4", "granularity": "channel", "group_size": 16, "backend": "quanto"}  # KIVICache's layout
KIVI_VALUES = {"format": "int4", "granularity": "token", "group_size": 16, "backend": "quanto"}  # (its groups are 32)
KIVI32_KEYS = {"format": "int4", "granularity": "channel", "group_size": 32, "backend": "quanto"}  # KIVICache's own
KIVI32_VALUES = {"format": "int4", "granularity": "token", "group_size": 32, "backend": "quanto"}
FULL = {"format": "none"}

# (keys spec, values spec, pack block, Hkv, groups, q, Dk, Dv, options)
CASES = {
    "fp8-token-decode": (FP8, FP8, None, 2, 1, 1, 32, 32, {}),
    # head dims the native kernel's FP8 register route compiles as constants (64: its query rows in registers with
    # 3 rows per KV head; 128 with 1 and 4 rows; values 64 channels at a time)
    "fp8-token-d64-gqa3": (FP8, FP8, None, 2, 3, 1, 64, 64, {"holes": True, "weights": True}),
    "fp8-token-d128-mha": (FP8, FP8, None, 2, 1, 1, 128, 128, {"holes": True}),
    "fp8-token-d128-gqa4": (FP8, FP8, None, 1, 4, 1, 128, 128, {"sinks": True}),
    "fp8-head-gqa-causal-holes": (
        FP8_HEAD,
        FP8_TENSOR,
        None,
        2,
        3,
        4,
        32,
        32,
        {"holes": True, "causal": True, "weights": True},
    ),
    "int8-keys-fp8-values-mla-softcap": (INT8, FP8_E5M2_G8, None, 1, 4, 2, 48, 16, {"softcap": 3.0}),
    "fp8-e8m0-sinks-gqa": (FP8_E8M0, INT8, None, 2, 4, 1, 32, 24, {"sinks": True, "holes": True}),
    "fp8-channel": (FP8_CHANNEL, FP8, None, 2, 2, 3, 32, 32, {"causal": True}),
    "kivi-int4-token-packed": (INT4_KEYS, INT4_VALUES, 16, 2, 2, 1, 32, 32, {"holes": True, "weights": True}),
    # KIVICache's layout (token-packed blocks, value groups a multiple of 16 channels): the native kernel's INT4
    # register route, keys and values
    "kivi-int4-register-route": (KIVI_KEYS, KIVI_VALUES, 16, 2, 3, 1, 64, 64, {"holes": True, "sinks": True}),
    # blocks of 32 tokens (16 byte rows): the native kernel's 16-row INT4 route (logits by the reduction tree)
    "kivi-int4-blocks-of-32": (
        KIVI32_KEYS,
        KIVI32_VALUES,
        32,
        2,
        3,
        1,
        64,
        64,
        {"holes": True, "weights": True, "whole": 32},
    ),
    "hqq-int2-channel-packed": (INT8, INT2_HQQ, None, 1, 2, 2, 16, 32, {"sinks": True, "softcap": 2.0}),
    "hqq-int2-token-packed": (FP8, INT2_HQQ, 16, 2, 1, 3, 32, 32, {"causal": True, "holes": True}),
    # full-precision segments (sinks, windows, residuals): the native kernel's float32 register route
    "full-precision-gqa": (FULL, FULL, None, 2, 3, 1, 64, 64, {"holes": True, "sinks": True, "weights": True}),
    "full-keys-fp8-values-causal": (FULL, FP8, None, 2, 2, 3, 32, 32, {"causal": True, "softcap": 2.5}),
}


def build_case(name, n=80, batch=2, seed=0, query_dtype=torch.float32):
    kspec, vspec, pack, hkv, groups, q, dk, dv, opts = CASES[name]
    n = -(-n // opts.get("whole", 1)) * opts.get("whole", 1)  # a store of whole key groups: rounded up to them
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, hkv * groups, q, dk, generator=gen) * 1.5).to(query_dtype)
    keys = quantized(kspec, torch.randn(batch, hkv, n, dk, generator=gen) * 2 + 0.3, pack)
    values = quantized(vspec, torch.randn(batch, hkv, n, dv, generator=gen), pack)
    kwargs = {"causal_tail": q if opts.get("causal") else 0, "softcap": opts.get("softcap")}
    if opts.get("sinks"):
        kwargs["sinks"] = torch.randn(hkv * groups, generator=gen) * 2
    if opts.get("weights"):  # H2O weighs queries (0: padding)
        kwargs["query_weight"] = (torch.rand(batch, q, generator=gen) > 0.3).float()
        kwargs["query_weight"][0, -1] = 0.0
    valid = None
    if opts.get("holes"):
        valid = torch.rand(batch, hkv, n, generator=gen) > 0.4
    return query, keys, values, valid, kwargs


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.fixture(scope="module")
def avx2_kernel():
    """The native kernel built for AVX2 without AVX-512 (-march=x86-64-v3): its 16-lane values are pairs of 256-bit
    registers (cpu_decode.cpp, HF_KVCACHE_V16_PAIR), code this machine's own build (x86-64-v4) does not run."""
    if not _has_avx2() or cpu_blockwise.unavailable() is not None:
        pytest.skip("needs an AVX2 CPU and a C++ toolchain")
    return cpu_blockwise._build(cpu_blockwise.compile_flags("x86-64-v3"))


@pytest.mark.parametrize("backend", ["torch", "native", "native-avx2"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dequantize_then_attend(name, backend, request, monkeypatch):
    if backend == "native-avx2":
        monkeypatch.setattr(cpu_blockwise, "_module", request.getfixturevalue("avx2_kernel"))
        backend = "native"
    query, keys, values, valid, kw = build_case(name)
    scaling = query.shape[-1] ** -0.5
    out, scores = blockwise_attention(
        query, keys, values, valid, scaling, block=32, return_column_scores=True, backend=backend, **kw
    )
    ref_out, ref_scores = dense_attention(query, keys, values, valid, scaling, **kw)
    assert out.shape == ref_out.shape and out.dtype == query.dtype
    atol = 2e-6 * max(1.0, query.shape[-1] / 64)  # (float32 sums of head_dim products: their rounding grows with it)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-5)
    torch.testing.assert_close(scores, ref_scores, atol=atol, rtol=1e-5)
    # the scores are attention probabilities: each query row sums to 1 (minus what the sinks took), times its weight
    weight = kw.get("query_weight", torch.ones(query.shape[0], query.shape[2]))
    total = weight.sum(1)[:, None].expand(-1, query.shape[1])
    assert (scores.sum(-1) <= total + 1e-4).all()
    if kw.get("sinks") is None:
        torch.testing.assert_close(scores.sum(-1), total, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries(dtype):
    query, keys, values, valid, kw = build_case("fp8-head-gqa-causal-holes", query_dtype=dtype)
    out = blockwise_attention(query, keys, values, valid, 0.2, block=16, **kw)
    ref, _ = dense_attention(query, keys, values, valid, 0.2, **kw)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel", ["native", "native-avx2"])
@pytest.mark.parametrize("dim", [64, 24])  # 64: the register route (16 channels at a time); 24: decoded rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_reads_half_precision_values_as_they_are(dtype, dim, kernel, request, monkeypatch):
    """Full-precision segments in bfloat16 / float16 (a bfloat16 model's sinks, windows and residuals) are read in
    their dtype and widened in registers, exactly: the same result, bit for bit, as the same values in float32."""
    if cpu_blockwise.unavailable() is not None:
        pytest.skip("needs the native kernel")
    if kernel == "native-avx2":
        monkeypatch.setattr(cpu_blockwise, "_module", request.getfixturevalue("avx2_kernel"))
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 6, 1, dim, generator=gen)
    k, v = (torch.randn(2, 2, 70, dim, generator=gen).to(dtype) for _ in range(2))
    valid = torch.rand(2, 2, 70, generator=gen) > 0.3
    meta = cpu_blockwise._flatten([QuantizedKV(k, "none")])[1]
    assert meta[1] == {torch.bfloat16: 4, torch.float16: 5}[dtype]  # no float32 copy was made
    out = blockwise_attention(query, QuantizedKV(k, "none"), QuantizedKV(v, "none"), valid, 0.125, backend="native")
    ref = blockwise_attention(
        query, QuantizedKV(k.float(), "none"), QuantizedKV(v.float(), "none"), valid, 0.125, backend="native"
    )
    assert torch.equal(out, ref)
    dense, _ = dense_attention(query, QuantizedKV(k.float(), "none"), QuantizedKV(v.float(), "none"), valid, 0.125)
    torch.testing.assert_close(out, dense, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["native", "native-avx2"])
@pytest.mark.parametrize(
    "name", ["fp8-token-decode", "fp8-channel", "int8-keys-fp8-values-mla-softcap", "full-keys-fp8-values-causal"]
)
def test_native_reads_half_precision_scales(name, kernel, request, monkeypatch):
    """FP8 scales are bfloat16 by default: the kernel reads them as they are on its FP8 register route (one scale per
    token and row) and converts them itself elsewhere (channel groups), never through a float32 copy made in Python
    at every step; the result is bit for bit that of float32 scales of the same values."""
    if cpu_blockwise.unavailable() is not None:
        pytest.skip("needs the native kernel")
    if kernel == "native-avx2":
        monkeypatch.setattr(cpu_blockwise, "_module", request.getfixturevalue("avx2_kernel"))
    query, keys, values, valid, kw = build_case(name)
    kw.pop("query_weight", None)
    as_float32 = lambda s: (
        dataclasses.replace(s, scale=s.scale.float())
        if s.scale is not None and (s.scale.dtype in (torch.bfloat16, torch.float16))
        else s
    )
    halves = [s for s in (keys, values) if s.scale is not None and s.scale.dtype in (torch.bfloat16, torch.float16)]
    assert halves  # the case has half-precision scales
    flat = cpu_blockwise.flatten_views([halves[0]])
    assert flat is not None and flat[0][1] is halves[0].scale  # handed over as they are
    out = blockwise_attention(query, keys, values, valid, 0.2, backend="native", **kw)
    ref = blockwise_attention(query, as_float32(keys), as_float32(values), valid, 0.2, backend="native", **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kernel", ["native", "native-avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,n,length",
    [
        ("kivi-int4-register-route", 80, 80),
        ("kivi-int4-register-route", 96, 90),
        ("kivi-int4-blocks-of-32", 96, 96),
        ("kivi-int4-token-packed", 80, 80),
        ("hqq-int2-token-packed", 80, 72),
        ("int8-keys-fp8-values-mla-softcap", 80, 80),
    ],
)
def test_native_reads_half_precision_integer_scales_and_zeros(name, n, length, dtype, kernel, request, monkeypatch):
    """A bfloat16 / float16 model's integer caches (KIVI) keep their scales and zero points in its dtype: the kernel
    reads them as they are, on the INT4 register routes and on the decoded rows (90 of 96 tokens: a partial block of
    keys), and the kernel's view of them is kept (no float32 copy at every step). Bit for bit the result of float32
    scales and zero points of the same values."""
    if cpu_blockwise.unavailable() is not None:
        pytest.skip("needs the native kernel")
    if kernel == "native-avx2":
        monkeypatch.setattr(cpu_blockwise, "_module", request.getfixturevalue("avx2_kernel"))
    query, keys, values, valid, kw = build_case(name, n=n)

    def rounded(s, to):  # integer segments' scales and zero points rounded to `dtype`, held in `to`
        if s.format not in ("int8", "int4", "int2"):
            return s
        return dataclasses.replace(s, scale=s.scale.to(dtype).to(to), zero=s.zero.to(dtype).to(to))

    def attend(k, v):  # the kernel's views of the segments, read over their first `length` tokens
        (fk, mk), (fv, mv) = cpu_blockwise.flatten_views([k]), cpu_blockwise.flatten_views([v])
        return cpu_blockwise.attend_flat(
            query,
            (fk, cpu_blockwise.with_lengths(mk, [length])),
            (fv, cpu_blockwise.with_lengths(mv, [length])),
            v.head_dim,
            k.heads,
            None if valid is None else valid[..., :length],
            0.2,
            kw["causal_tail"],
            kw["softcap"],
            kw.get("sinks"),
        )

    half_k, half_v = rounded(keys, dtype), rounded(values, dtype)
    integer = [s for s in (half_k, half_v) if s.format in ("int8", "int4", "int2")]
    flat = cpu_blockwise.flatten_views(integer)
    assert flat is not None and flat[0][1] is integer[0].scale and flat[0][2] is integer[0].zero  # as they are
    out = attend(half_k, half_v)
    assert torch.equal(out, attend(rounded(keys, torch.float32), rounded(values, torch.float32)))
    if length == n:  # and the checked entry agrees
        assert torch.equal(out, blockwise_attention(query, half_k, half_v, valid, 0.2, backend="native", **kw))


def test_native_refuses_lengths_beyond_the_buffers():
    """A caller may hand whole buffers and shorter lengths (codes_read.KernelView); a length past a buffer is an
    error naming the segment, never a read out of bounds."""
    if cpu_blockwise.unavailable() is not None:
        pytest.skip("needs the native kernel")
    query, keys, values, _valid, _kw = build_case("fp8-token-decode", n=40)
    flat_k, flat_v = cpu_blockwise._flatten([keys]), cpu_blockwise._flatten([values])
    out = cpu_blockwise.attend_flat(query, flat_k, flat_v, 32, 2, None, 0.2)
    ref = blockwise_attention(query, keys, values, None, 0.2, backend="native")
    assert torch.equal(out, ref)
    shorter = (flat_k[0], cpu_blockwise.with_lengths(flat_k[1], [30]))
    out = cpu_blockwise.attend_flat(
        query, shorter, (flat_v[0], cpu_blockwise.with_lengths(flat_v[1], [30])), 32, 2, None, 0.2
    )
    first = [
        QuantizedKV(s.codes[:, :, :30], s.format, s.scale[:, :, :30], "token", s.group_size) for s in (keys, values)
    ]
    assert torch.equal(out, blockwise_attention(query, *first, None, 0.2, backend="native"))
    with pytest.raises(RuntimeError, match="segment 0 reads 41 tokens, its codes hold 40"):
        cpu_blockwise.attend_flat(
            query, (flat_k[0], cpu_blockwise.with_lengths(flat_k[1], [41])), flat_v, 32, 2, None, 0.2
        )


@pytest.mark.parametrize("block", [1, 7, 80, 1000])
def test_block_size_does_not_change_the_result(block):
    query, keys, values, valid, kw = build_case("fp8-e8m0-sinks-gqa")
    ref, ref_scores = blockwise_attention(query, keys, values, valid, 0.3, block=32, return_column_scores=True, **kw)
    out, scores = blockwise_attention(query, keys, values, valid, 0.3, block=block, return_column_scores=True, **kw)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(scores, ref_scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_with_no_visible_column_give_zeros(q, sinks):
    query, keys, values, _, _ = build_case("fp8-token-decode", n=40)
    query = query[:, :, :1].expand(-1, -1, q, -1).contiguous()
    valid = torch.ones(2, 1, 40, dtype=torch.bool)
    valid[1] = False  # batch row 1 sees nothing
    sink = torch.zeros(query.shape[1]) if sinks else None
    out, scores = blockwise_attention(query, keys, values, valid, 0.2, block=16, sinks=sink, return_column_scores=True)
    assert torch.isfinite(out).all() and torch.isfinite(scores).all()
    assert (out[1] == 0).all() and (scores[1] == 0).all()
    assert out[0].abs().sum() > 0 and scores[0].sum() > 0.5
    ref, ref_scores = dense_attention(query, keys, values, valid, 0.2, sinks=sink)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(scores, ref_scores, atol=2e-6, rtol=1e-5)


def segments_case(empty_first=False):
    """A store's layout: quantized tokens (KIVI int4), then a full-precision residual; the causal tail spans the
    boundary. `empty_first`: an empty quantized segment in front (nothing quantized yet)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 3, 32, generator=gen)
    k_old, v_old = torch.randn(1, 2, 64, 32, generator=gen), torch.randn(1, 2, 64, 32, generator=gen)
    k_new, v_new = torch.randn(1, 2, 2, 32, generator=gen), torch.randn(1, 2, 2, 32, generator=gen)
    keys = [quantized(INT4_KEYS, k_old, 16), QuantizedKV(k_new, "none")]
    values = [quantized(INT4_VALUES, v_old, 16), QuantizedKV(v_new, "none")]
    if empty_first:
        keys.insert(0, quantized(FP8, k_old[:, :, :0]))
        values.insert(0, quantized(INT8, v_old[:, :, :0]))
    valid = torch.rand(1, 1, 66, generator=gen) > 0.3
    return query, keys, values, valid, {"causal_tail": 3}


@pytest.mark.parametrize("empty_first", [False, True])
def test_segments_quantized_then_full_precision(empty_first):
    query, keys, values, valid, kw = segments_case(empty_first)
    out, scores = blockwise_attention(query, keys, values, valid, 0.25, block=32, return_column_scores=True, **kw)
    ref, ref_scores = dense_attention(query, keys, values, valid, 0.25, **kw)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(scores, ref_scores, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [FP8, FP8_E5M2_G8, FP8_E8M0, FP8_HEAD, FP8_TENSOR, FP8_CHANNEL, INT8, INT4_KEYS, INT4_VALUES, INT2_HQQ],
    ids=str,
)
@pytest.mark.parametrize("pack_block", [None, 16])
def test_from_codec_dequantizes_like_the_codec(spec, pack_block):
    x = torch.randn(2, 3, 48, 32) * 3
    codec = codec_for(spec, x, pack_block)
    expected = torch.empty_like(x)
    codec.decode_into(expected, 48, TransientWorkspace())
    kv = from_codec(codec, 48)
    torch.testing.assert_close(dequantize(kv), expected, atol=1e-6, rtol=1e-6)
    assert (kv.length, kv.head_dim, kv.heads) == (48, 32, 3)


@pytest.mark.parametrize(
    "key, value, kwargs",
    [
        (INT4_KEYS, INT4_VALUES, {"residual": 16, "append_only": True}),  # KIVI: token-packed blocks + residual
        (FP8, FP8, {"key_smoothing": True}),  # joint codec (keys and values in one buffer), key mean as bias
        (FP8_HEAD, INT8, {}),
    ],
    ids=["kivi-residual", "joint-smoothed", "mixed"],
)
def test_store_segments_match_the_store_read(key, value, kwargs):
    store = QuantizedStore(key, value, **kwargs)
    gen = torch.Generator().manual_seed(1)
    store.allocate(2, 2, 32, 64, torch.float32, "cpu")
    k, v = torch.randn(2, 2, 53, 32, generator=gen) + 1.0, torch.randn(2, 2, 53, 32, generator=gen)
    for slot in range(53):  # token by token, as in decoding (KIVI: 16-token blocks leave the residual)
        store.write_slot(slot, k[:, :, slot : slot + 1], v[:, :, slot : slot + 1])
    keys, values = store_segments(store, 53)
    assert [s.format for s in keys] == ([key["format"], "none"] if kwargs.get("residual") else [key["format"]])
    read_k, read_v = store.read(53)
    torch.testing.assert_close(torch.cat([dequantize(s) for s in keys], 2), read_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([dequantize(s) for s in values], 2), read_v, atol=1e-6, rtol=1e-6)
    query = torch.randn(2, 4, 1, 32, generator=gen)
    out = blockwise_attention(query, keys, values, None, 0.2, block=32)
    probs = torch.softmax(query @ read_k.repeat_interleave(2, 1).transpose(-1, -2) * 0.2, -1)
    torch.testing.assert_close(out, probs @ read_v.repeat_interleave(2, 1), atol=2e-6, rtol=1e-5)


def test_errors_name_the_parameter():
    query, keys, values, _, _ = build_case("kivi-int4-token-packed", n=32)
    with pytest.raises(ValueError, match=r"`backend` must be one of \('auto', 'torch', 'triton', 'native'\)"):
        blockwise_attention(query, keys, values, None, 0.2, backend="cuda")
    with pytest.raises(ValueError, match=r"`block` \(8\) must be a multiple of 16"):
        blockwise_attention(query, keys, values, None, 0.2, block=8)
    with pytest.raises(ValueError, match="`causal_tail` must be 0 or the query length 1"):
        blockwise_attention(query, keys, values, None, 0.2, causal_tail=2)
    with pytest.raises(ValueError, match="`valid` must be bool"):
        blockwise_attention(query, keys, values, torch.ones(2, 1, 31, dtype=torch.bool), 0.2)
    with pytest.raises(ValueError, match="`sinks` must be"):
        blockwise_attention(query, keys, values, None, 0.2, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="`format` must be one of"):
        QuantizedKV(keys.codes, "int3", keys.scale, "channel", 16)
    with pytest.raises(ValueError, match="`scale` for granularity 'token' must be"):
        QuantizedKV(torch.zeros(1, 1, 4, 8, dtype=torch.uint8), "fp8_e4m3", torch.ones(1, 1, 3, 1), "token", 8)


def test_triton_backend_refuses_to_run_where_it_cannot(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    query, keys, values, _, _ = build_case("fp8-token-decode", n=16)
    with pytest.raises(RuntimeError, match="backend='triton'.*needs CUDA"):
        blockwise_attention(query, keys, values, None, 0.2, backend="triton")
    auto = blockwise_attention(query, keys, values, None, 0.2, backend="auto")  # CPU: the native kernel
    torch.testing.assert_close(auto, blockwise_attention(query, keys, values, None, 0.2, backend="native"))


def test_native_backend_says_why_it_cannot_run_and_auto_falls_back(monkeypatch):
    query, keys, values, _, _ = build_case("fp8-token-decode", n=16)
    torch_path = blockwise_attention(query, keys, values, None, 0.2, backend="torch")
    monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    with pytest.raises(RuntimeError, match=r"backend='native'.*HF_KVCACHE_NATIVE=0"):
        blockwise_attention(query, keys, values, None, 0.2, backend="native")
    assert torch.equal(blockwise_attention(query, keys, values, None, 0.2, backend="auto"), torch_path)
    monkeypatch.delenv("HF_KVCACHE_NATIVE")
    # a machine without a compiler: the build's error is the reason, reported once, and "auto" keeps the torch path
    monkeypatch.setattr(cpu_blockwise, "_module", None)
    monkeypatch.setattr(cpu_blockwise, "_failure", None)

    def no_compiler():
        raise OSError("g++: not found")

    monkeypatch.setattr(cpu_blockwise, "_build", no_compiler)
    assert cpu_blockwise.unavailable() == "building the native CPU kernel failed (OSError: g++: not found)"
    with pytest.raises(RuntimeError, match=r"backend='native'.*cannot run here: building the native CPU kernel failed"):
        blockwise_attention(query, keys, values, None, 0.2, backend="native")
    assert torch.equal(blockwise_attention(query, keys, values, None, 0.2, backend="auto"), torch_path)
    meta = torch.zeros(query.shape, device="meta")
    assert "CPU tensors" in cpu_blockwise.unsupported(meta, [keys], [values])


def test_native_build_is_named_for_its_torch_and_python(monkeypatch):
    """A build made against one torch must never load in another: an in-place torch upgrade keeps every path, so the
    extension's name (its folder in torch's shared extension cache) carries torch's and Python's versions."""
    name = cpu_blockwise.module_name()
    assert name == cpu_blockwise.module_name()  # (stable: built once, then loaded)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    upgraded = cpu_blockwise.module_name()
    assert upgraded != name and upgraded.startswith("hf_kvcache_cpu_decode_")
    monkeypatch.setattr(cpu_blockwise.sys, "version_info", (3, 99, 0))
    assert cpu_blockwise.module_name() not in (name, upgraded)
    assert cpu_blockwise.module_name(["-O0"]) != cpu_blockwise.module_name()


@pytest.mark.skipif(cpu_blockwise.unavailable() is not None, reason="the native CPU kernel does not build here")
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's extension loader takes a lock file in the build folder on every load; a process killed while holding
    it left every later process waiting forever, silently. An existing build now loads without that lock."""
    lock = cpu_blockwise.build_root() / cpu_blockwise.module_name() / "lock"
    lock.touch()
    try:
        code = "from hf_kvcache.kernels import cpu_blockwise; print(cpu_blockwise.unavailable())"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "None"


def test_only_a_stale_build_lock_is_cleared(tmp_path, caplog):
    lock = tmp_path / "lock"
    assert not cpu_blockwise.clear_stale_lock(tmp_path)  # none there
    lock.touch()
    mtime = lock.stat().st_mtime
    assert not cpu_blockwise.clear_stale_lock(tmp_path, now=mtime + 60)  # a build in progress elsewhere: kept
    assert lock.exists()
    with caplog.at_level("WARNING"):
        assert cpu_blockwise.clear_stale_lock(tmp_path, now=mtime + cpu_blockwise.STALE_LOCK_S + 1)
    assert not lock.exists() and "stale build lock" in caplog.text


def test_builders_take_turns_and_a_killed_builder_leaves_no_lock(tmp_path):
    """The builder lock is the OS's: a second builder waits while the first lives, and a builder killed mid-build
    (SIGKILL) leaves nothing to wait on, however long its build ran."""
    fcntl = pytest.importorskip("fcntl")
    directory = tmp_path / "build"
    directory.mkdir()
    code = (
        "import time; from pathlib import Path; from hf_kvcache.kernels import cpu_blockwise\n"
        f"with cpu_blockwise.builder_lock(Path({str(directory)!r})):\n"
        "    print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.builder.lock", "w") as handle:
            with pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait()
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with its process
    finally:
        holder.kill()


def test_a_torch_lock_left_by_a_killed_builder_does_not_block_the_next(tmp_path, monkeypatch):
    """Holding the builder lock, a fresh torch lock in the folder is a dead builder's (a live one would hold the
    builder lock): it is removed at once, not after STALE_LOCK_S."""
    from torch.utils import cpp_extension

    pytest.importorskip("fcntl")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_blockwise.module_name(["-O0"])
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").touch()  # fresh: the age rule would keep it
    seen = []

    def load(**kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        return "built"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_blockwise._build(["-O0"]) == "built" and seen == [False]


AVX512_NODE = (
    "fpu sse2 ssse3 sse4_1 sse4_2 cx16 popcnt lahf_lm movbe xsave avx f16c fma abm bmi1 avx2 bmi2 avx512f "
    "avx512dq avx512cd avx512bw avx512vl avx512_vnni"
)
AVX2_NODE = "fpu sse2 ssse3 sse4_1 sse4_2 cx16 popcnt lahf_lm movbe xsave avx f16c fma abm bmi1 avx2 bmi2"


def test_native_build_is_keyed_on_the_instruction_set_it_targets(monkeypatch):
    """Nodes of different CPUs sharing one home directory (~/.cache on NFS) share torch's extension folder: a build
    made on an AVX-512 node must never load on an AVX2 node (an illegal instruction kills the process, no exception).
    Two faked CPUs: each builds for its own level, under its own name; CPUs of one level share a build."""
    assert cpu_blockwise.isa_target("x86_64", AVX512_NODE) == "x86-64-v4"
    assert cpu_blockwise.isa_target("x86_64", AVX2_NODE) == "x86-64-v3"
    assert cpu_blockwise.isa_target("x86_64", "fpu sse2 ssse3 sse4_1 sse4_2 cx16 popcnt lahf_lm") == "x86-64-v2"
    assert cpu_blockwise.isa_target("x86_64", "fpu sse2") == "x86-64"
    # AVX-512 flags without AVX2 (never seen, but the levels are cumulative): v2, not v4
    assert (
        cpu_blockwise.isa_target(
            "x86_64", "ssse3 sse4_1 sse4_2 cx16 popcnt lahf_lm avx512f avx512dq avx512cd avx512bw avx512vl"
        )
        == "x86-64-v2"
    )
    names = {}
    for node, features in (
        ("avx512", AVX512_NODE),
        ("avx2", AVX2_NODE),
        ("avx512 + fp16", AVX512_NODE + " avx512_fp16"),
    ):
        monkeypatch.setattr(cpu_blockwise, "cpu_features", lambda features=features: features)
        flags = cpu_blockwise.compile_flags()
        assert flags.count("-march=native") == 0 and sum(f.startswith("-march=") for f in flags) == 1
        names[node] = (flags, cpu_blockwise.module_name(flags))
    assert "-march=x86-64-v4" in names["avx512"][0] and "-march=x86-64-v3" in names["avx2"][0]
    assert names["avx512"][1] != names["avx2"][1]
    assert names["avx512"][1] == names["avx512 + fp16"][1]  # same level, same code: one build serves both
    # elsewhere (Arm): -march=native, named by the CPU's feature list
    arm = {}
    monkeypatch.setattr(cpu_blockwise.platform, "machine", lambda: "aarch64")
    for features in ("fp asimd crc32 atomics", "fp asimd crc32 atomics sve sve2"):
        monkeypatch.setattr(cpu_blockwise, "cpu_features", lambda features=features: features)
        flags = cpu_blockwise.compile_flags()
        assert "-march=native" in flags
        arm[features] = cpu_blockwise.module_name(flags)
    assert len(set(arm.values())) == 2


def test_native_kernel_is_the_same_on_one_thread_or_several():
    query, keys, values, valid, kw = build_case("fp8-head-gqa-causal-holes", n=70, batch=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = blockwise_attention(query, keys, values, valid, 0.2, return_column_scores=True, backend="native", **kw)
        torch.set_num_threads(max(2, threads))
        several = blockwise_attention(
            query, keys, values, valid, 0.2, return_column_scores=True, backend="native", **kw
        )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, several))  # one task per (batch row, KV head): same sums


# -- memory ---------------------------------------------------------------------------------------------------------
class PeakStorage(TorchDispatchMode):
    """Peak bytes of the storages created by ops inside the mode and still alive (inputs excluded)."""

    def __init__(self, inputs):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: (ref, size) for ptr, (ref, size) in self.live.items() if not ref.expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.known and ptr not in self.live:
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def _peak(fn, inputs) -> int:
    mode = PeakStorage(inputs)
    with mode:
        fn()
    return mode.peak


def test_extra_memory_is_o_block_while_dequantize_then_attend_is_o_n(record_property):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 1, 64, generator=gen)
    peaks = {}
    for n in (1024, 8192):
        keys = quantized(FP8, torch.randn(1, 2, n, 64, generator=gen))
        values = quantized(INT8, torch.randn(1, 2, n, 64, generator=gen))
        inputs = (query, keys.codes, keys.scale, values.codes, values.scale, values.zero)
        # the torch path (the native kernel's scratch, TILE x n logits per thread, is outside torch's allocator)
        peaks["blockwise", n] = _peak(
            lambda: blockwise_attention(query, keys, values, None, 0.125, block=256, backend="torch"), inputs
        )
        peaks["dense", n] = _peak(lambda: dense_attention(query, keys, values, None, 0.125), inputs)
    record_property("peak_bytes", {f"{kind}@{n}": v for (kind, n), v in peaks.items()})
    print("peak extra bytes:", peaks)
    assert peaks["blockwise", 8192] == peaks["blockwise", 1024]  # independent of n
    assert peaks["dense", 8192] > 7 * peaks["dense", 1024]  # grows linearly
    assert peaks["dense", 1024] > 2 * peaks["blockwise", 1024]
    # one block of keys and values in float32 (+ logits) bounds it: 2 x 256 x 2 heads x 64 x 4 bytes = 256 KiB
    assert peaks["blockwise", 8192] < 3 * 2 * 256 * 2 * 64 * 4


# -- torch.compile ----------------------------------------------------------------------------------------------------
def test_torch_path_compiles_fullgraph_and_matches_eager():
    query, keys, values, valid, kw = build_case("fp8-e8m0-sinks-gqa", n=32, batch=1)  # two blocks: compile is slow

    def attend(query, keys, values, valid, sinks):
        return blockwise_attention(
            query, keys, values, valid, 0.2, block=16, sinks=sinks, backend="torch", return_column_scores=True
        )

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    out, scores = compiled(query, keys, values, valid, kw["sinks"])
    ref, ref_scores = attend(query, keys, values, valid, kw["sinks"])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)


# -- Triton kernel under the interpreter ------------------------------------------------------------------------------
TRITON_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    import test_blockwise_attention as t
    from hf_kvcache.kernels import blockwise_attention
    results = {{}}
    for name, n in {cases!r}:
        if name.startswith("segments"):
            query, keys, values, valid, kw = t.segments_case(empty_first=name.endswith("empty"))
        else:
            query, keys, values, valid, kw = t.build_case(name, n=n)
        args = (query, keys, values, valid, 0.3)
        ref, ref_scores = blockwise_attention(*args, block=16, return_column_scores=True, backend="torch", **kw)
        out, scores = blockwise_attention(*args, return_column_scores=True, backend="triton", **kw)
        results[name] = [float((out - ref).abs().max()), float((scores - ref_scores).abs().max()),
                         bool(torch.isfinite(out).all())]
    print(json.dumps(results))
    """
)


def test_triton_kernel_under_interpreter_matches_torch():
    pytest.importorskip("triton")
    cases = [
        ("fp8-token-decode", 70),
        ("fp8-head-gqa-causal-holes", 40),
        ("int8-keys-fp8-values-mla-softcap", 33),
        ("fp8-e8m0-sinks-gqa", 48),
        ("kivi-int4-token-packed", 64),
        ("hqq-int2-token-packed", 48),
        ("fp8-channel", 48),
        ("segments", 66),
        ("segments-empty", 66),
    ]
    script = TRITON_SCRIPT.format(tests=os.path.dirname(__file__), cases=cases)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(name for name, _ in cases)
    for name, (out_err, score_err, finite) in results.items():
        assert finite, name
        assert out_err < 2e-5 and score_err < 2e-6, (name, out_err, score_err)


# -- flash-decoding: a unit's columns in ranges, merged ----------------------------------------------------------------
def _native(query, keys, values, valid, scaling, split, causal_tail=0, softcap=None, sinks=None, query_weight=None):
    ks = keys if isinstance(keys, list) else [keys]
    vs = values if isinstance(values, list) else [values]
    n = sum(s.length for s in ks)
    return cpu_blockwise.cpu_blockwise_attention(
        query, ks, vs, n, valid, scaling, causal_tail, softcap, sinks, False, query_weight, split_columns=split
    )


@pytest.mark.parametrize("split", [7, 16, 33])
@pytest.mark.parametrize("name", sorted(CASES))
def test_native_ranges_merge_to_the_one_pass_attention(name, split):
    """Columns split into ranges (of sizes that straddle the packing blocks, the causal tail and the holes), each
    with its own max and sum, merged: the dense reference's output."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    query, keys, values, valid, kw = build_case(name)
    scaling = query.shape[-1] ** -0.5
    out = _native(query, keys, values, valid, scaling, split, **kw)
    ref, _ = dense_attention(query, keys, values, valid, scaling, **kw)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("empty_first", [False, True])
def test_native_ranges_across_segments(empty_first):
    """A range that starts in the quantized segment and ends in the full-precision residual (and the tail)."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    query, keys, values, valid, kw = segments_case(empty_first)
    for split in (5, 30, 65):
        out = _native(query, keys, values, valid, 0.25, split, **kw)
        ref, _ = dense_attention(query, keys, values, valid, 0.25, **kw)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_native_ranges_where_a_whole_range_sees_nothing():
    """A range whose columns are all hidden contributes nothing (its max is -inf); a row that sees nothing at all
    gets zeros, with or without sinks."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    query, keys, values, _, _ = build_case("fp8-token-decode", n=64)
    valid = torch.ones(2, 1, 64, dtype=torch.bool)
    valid[0, :, 16:48] = False  # ranges 1 and 2 of 4 (16 columns each) hidden in row 0
    valid[1] = False
    for sinks in (None, torch.zeros(query.shape[1])):
        out = _native(query, keys, values, valid, 0.2, 16, sinks=sinks)
        ref, _ = dense_attention(query, keys, values, valid, 0.2, sinks=sinks)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        assert (out[1] == 0).all() and out[0].abs().sum() > 0


def test_native_decode_splits_a_long_context_by_itself_and_not_by_threads():
    """Batch-1 decode over 4K columns (one unit per KV head): the kernel splits the columns by itself; the result is
    the reference's, and the same on one thread or several (the ranges follow from the shapes)."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    query, keys, values, valid, kw = build_case("fp8-token-decode", n=4096, batch=1)
    ref, _ = dense_attention(query, keys, values, valid, 0.1, **kw)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = blockwise_attention(query, keys, values, valid, 0.1, backend="native", **kw)
        torch.set_num_threads(max(2, threads))
        several = blockwise_attention(query, keys, values, valid, 0.1, backend="native", **kw)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(one, several)
    whole = _native(query, keys, values, valid, 0.1, 4096, **kw)  # one range: the one-pass route
    assert not torch.equal(one, whole)  # so the default really split (sums in another order)
    torch.testing.assert_close(one, whole, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "name, aligned, unaligned", [("kivi-int4-blocks-of-32", 640, 600), ("fp8-token-decode", 640, 600)]
)
def test_native_decode_ranges_end_on_whole_blocks(name, aligned, unaligned):
    """A split batch-1 decode cuts its columns at multiples of 64 (and of the INT4 packing block): 3000 columns over
    2 KV heads make 5 ranges of 600, rounded up to 640, so no range edge falls inside a block or a 16-token group
    (an edge there sent the block's tokens through the slow decoded-row route)."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    query, keys, values, valid, kw = build_case(name, n=3000, batch=1)
    auto = blockwise_attention(query, keys, values, valid, 0.1, backend="native", **kw)
    assert torch.equal(auto, _native(query, keys, values, valid, 0.1, aligned, **kw))
    assert not torch.equal(auto, _native(query, keys, values, valid, 0.1, unaligned, **kw))
    ref, _ = dense_attention(query, keys, values, valid, 0.1, **kw)
    torch.testing.assert_close(auto, ref, atol=2e-6, rtol=1e-5)


def test_native_decode_rotates_the_query_inside_the_call():
    """A cache that stores its keys rotated (FP8's Hadamard key rotation) hands the kernel its rotation with the
    unrotated query: the kernel's output equals that of the query rotated beforehand (to float32 rounding: the
    product's sums run in another order), and a rotation of the wrong shape is an error naming it."""
    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    from hf_kvcache.common.rotation import rotation_matrix

    query, keys, values, valid, kw = build_case("fp8-head-gqa-causal-holes", n=300, batch=2)
    kw = {k: v for k, v in kw.items() if k != "query_weight"}
    rotation = rotation_matrix("hadamard", query.shape[-1])
    args = ([keys], [values], keys.length, valid, 0.2, kw["causal_tail"], kw["softcap"], None, False)
    inside = cpu_blockwise.cpu_blockwise_attention(query, *args, query_rotation=rotation)
    before = cpu_blockwise.cpu_blockwise_attention(query @ rotation, *args)
    torch.testing.assert_close(inside, before, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(inside, cpu_blockwise.cpu_blockwise_attention(query, *args), atol=1e-3)
    with pytest.raises(RuntimeError, match="query_rotation"):
        cpu_blockwise.cpu_blockwise_attention(query, *args, query_rotation=rotation[:-1])
