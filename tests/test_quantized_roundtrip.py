"""Per-element round-trip error within each format's bound, for any shape, magnitude and layout (hypothesis), and a
defined result for all-zero, tiny, huge (saturating) and non-finite input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hf_kvcache.stores.quantization import NonFiniteError, QuantSpec, backend_available
from hf_kvcache.stores.quantized import QuantizedStore
from hf_kvcache.stores.workspace import DequantWorkspace

INT_BACKENDS = ["torch"] + [b for b in ("quanto", "hqq") if backend_available(b)]
PACKING_BACKENDS = [b for b in ("quanto", "hqq") if backend_available(b)]
FP8 = {
    "fp8_e4m3": (torch.float8_e4m3fn, 2.0**-4, 2.0**-6, 2.0**-9),
    "fp8_e5m2": (torch.float8_e5m2, 2.0**-3, 2.0**-14, 2.0**-16),
}


def roundtrip(key: QuantSpec, x: torch.Tensor, append_only: bool = False) -> tuple[torch.Tensor, QuantizedStore]:
    """Write x [B, H, n, D] as keys (values: full precision) and read it back."""
    b, h, n, d = x.shape
    store = QuantizedStore(key, "none", append_only=append_only, workspace=DequantWorkspace())
    store.allocate(b, h, d, n + 1, x.dtype, "cpu")
    store.write(torch.arange(n).expand(b, 1, n), x, torch.zeros_like(x), start=0)
    keys, _ = store.read(n)
    return keys.clone(), store


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_bit_conversion_equals_the_native_one_for_every_code(fmt):
    """The CPU read path's integer route to float16 (stores/fp8.fp8_as_half) times its factor gives exactly torch's
    own FP8 -> float32 conversion for all 256 codes: signs, zeros, subnormals, the largest values, E5M2's infinities
    (NaN codes aside)."""
    from hf_kvcache.stores.fp8 import fp8_as_half

    dtype = FP8[fmt][0]
    codes = torch.arange(256, dtype=torch.uint8).view(1, 1, 4, 64)
    native = codes.view(dtype).float()
    half, factor = fp8_as_half(codes, dtype, torch.full(codes.shape, 12345, dtype=torch.int16))
    converted = half.float() * factor
    number = ~native.isnan()  # (E5M2's infinities included)
    assert number.sum() == {"fp8_e4m3": 254, "fp8_e5m2": 250}[fmt]
    assert torch.equal(converted[number], native[number])
    assert torch.equal(converted[number].signbit(), native[number].signbit())  # -0.0 stays negative zero


@st.composite
def tensors(draw, dims=(16, 32, 64), max_tokens=12, token_multiple=1):
    b = draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_tokens)) * token_multiple
    d = draw(st.sampled_from(dims))
    data = draw(hnp.arrays(np.float32, (b, h, n, d), elements=st.floats(-1e3, 1e3, width=32)))
    exponent = draw(st.integers(-30, 30))  # overall magnitude, from tiny to huge
    return torch.from_numpy(data) * 2.0**exponent


def fp8_bound(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """|error| allowed per element: FP8 rounding relative to the value for normal values, half the subnormal spacing
    (times the scale) below, plus float32 rounding of the final multiply."""
    _, rel, _, sub = FP8[fmt]
    return torch.maximum(rel * x.abs(), 0.5 * sub * scale) * (1 + 1e-6) + 1e-6 * x.abs()


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    x=tensors(),
    fmt=st.sampled_from(list(FP8)),
    group=st.sampled_from([None, 8, 16]),
    scale_dtype=st.sampled_from([None, "float16", "float32", "e8m0"]),
)
def test_fp8_token_round_trip(x, fmt, group, scale_dtype):
    spec = QuantSpec(fmt, "token", group, scale_dtype=scale_dtype)
    y, store = roundtrip(spec, x)
    g = group or x.shape[-1]
    fmax = torch.finfo(FP8[fmt][0]).max
    # float16 scales end at 65504: beyond fmax * 65504 values saturate (a defined result, not an error)
    limit = fmax * 65504.0 if scale_dtype == "float16" else math.inf
    target = x.clamp(-limit, limit)
    # the scale each element was divided by (what the store keeps, as float32)
    stored = store.keys_codec.slot["scale"][:, :, : x.shape[2]]
    scale = torch.exp2(stored.float()) if scale_dtype == "e8m0" else stored.float()
    assert torch.isfinite(y).all()
    err = (y - target).abs()
    bound = fp8_bound(target, scale.repeat_interleave(g, -1), fmt)
    assert (err <= bound).all(), float((err - bound).max())
    # the scale covers the group: its largest value is not clipped (up to FP8 rounding)
    amax = target.abs().unflatten(-1, (x.shape[-1] // g, g)).amax(-1)
    assert (amax <= scale * fmax * (1 + 1e-6)).all()


@SETTINGS
@given(x=tensors(token_multiple=4, max_tokens=4), fmt=st.sampled_from(list(FP8)))
def test_fp8_channel_round_trip(x, fmt):
    spec = QuantSpec(fmt, "channel", 4)
    y, store = roundtrip(spec, x, append_only=True)
    scale = store.keys_codec.slot["scale"][:, :, : x.shape[2] // 4].float().repeat_interleave(4, 2)
    assert ((y - x).abs() <= fp8_bound(x, scale, fmt)).all()


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(list(FP8)), gran=st.sampled_from(["head", "tensor"]))
def test_fp8_fixed_scale_round_trip(x, fmt, gran):
    """Warm-up scales: the first write fixes them from its maximum, so nothing in it saturates."""
    y, store = roundtrip(QuantSpec(fmt, gran), x)
    scale = store.keys_codec.scale.expand_as(x)
    assert ((y - x).abs() <= fp8_bound(x, scale, fmt)).all()


@SETTINGS
@given(
    x=tensors(),
    bits=st.sampled_from([8, 4, 2]),
    group=st.sampled_from([None, 8, 16]),
    backend=st.sampled_from([b for b in INT_BACKENDS if b != "hqq"]),
    scale_dtype=st.sampled_from([None, "bfloat16"]),
)
def test_int_token_within_half_a_step(x, bits, group, backend, scale_dtype):
    if bits != 8 and backend == "torch":
        backend = PACKING_BACKENDS[0] if PACKING_BACKENDS else pytest.skip("no packing backend installed")
    spec = QuantSpec(f"int{bits}", "token", group, backend, scale_dtype)
    y, store = roundtrip(spec, x)
    g = group or x.shape[-1]
    step = store.keys_codec.slot["scale"][:, :, : x.shape[2]].float().repeat_interleave(g, -1)
    err = (y - x).abs()
    assert (err <= 0.5 * step * (1 + 1e-5) + 1e-6 * x.abs()).all(), float((err / step).max())


@SETTINGS
@given(x=tensors(token_multiple=4, max_tokens=3), bits=st.sampled_from([8, 4, 2]))
def test_int_channel_within_half_a_step(x, bits):
    backend = "torch" if bits == 8 else (PACKING_BACKENDS[0] if PACKING_BACKENDS else None)
    if backend is None:
        pytest.skip("no packing backend installed")
    y, store = roundtrip(QuantSpec(f"int{bits}", "channel", 4, backend), x, append_only=True)
    step = store.keys_codec.slot["scale"][:, :, : x.shape[2] // 4].float().repeat_interleave(4, 2)
    assert ((y - x).abs() <= 0.5 * step * (1 + 1e-5) + 1e-6 * x.abs()).all()


@pytest.mark.skipif(not backend_available("hqq"), reason="hqq is not installed")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=tensors(dims=(16, 32), token_multiple=4, max_tokens=3),
    bits=st.sampled_from([8, 4, 2]),
    granularity=st.sampled_from(["token", "channel"]),
)
def test_hqq_round_trip_is_bounded(x, bits, granularity):
    """HQQ optimises the zero point for an l_p (p < 1) error, not the max error: values stay within the group's range
    widened by one step, and the mean error is at most half a step."""
    channel = granularity == "channel"
    y, store = roundtrip(QuantSpec(f"int{bits}", granularity, 4 if channel else None, "hqq"), x, append_only=channel)
    if channel:  # one group = one channel over 4 tokens: put the group dim last
        x, y = (t.unflatten(2, (t.shape[2] // 4, 4)).transpose(-1, -2) for t in (x, y))
        step = store.keys_codec.slot["scale"][:, :, : x.shape[2]].float()
    else:
        step = store.keys_codec.slot["scale"][:, :, : x.shape[2], 0].float()
    lo, hi = x.amin(-1), x.amax(-1)
    tol = step * 1.01 + 1e-5 * x.abs().amax(-1)
    assert (y.amin(-1) >= lo - tol).all() and (y.amax(-1) <= hi + tol).all()
    assert ((y - x).abs().mean(-1) <= 0.5 * step + 1e-6 * x.abs().amax(-1)).all()


def test_hqq_and_quanto_pack_the_same_values_differently():
    """Both libraries do the packing: same codes, different byte layouts, same decoded values (min-max start)."""
    if len(PACKING_BACKENDS) < 2:
        pytest.skip("needs both optimum-quanto and hqq")
    x = torch.randn(1, 2, 5, 16)
    yq, sq = roundtrip(QuantSpec("int4", "token", None, "quanto"), x)
    yh, sh = roundtrip(QuantSpec("int4", "token", None, "hqq"), x)
    assert sq.keys_codec.slot["data"].shape == sh.keys_codec.slot["data"].shape == (1, 2, 6, 8)
    assert not torch.equal(sq.keys_codec.slot["data"], sh.keys_codec.slot["data"])  # quanto: low nibble first
    step = sq.keys_codec.slot["scale"][:, :, :5, 0].float()
    assert ((yq - yh).abs().amax(-1) <= 2 * step).all()


# -- special inputs --------------------------------------------------------------------------------------------
ALL_SPECS = [
    QuantSpec("fp8_e4m3", "token"),
    QuantSpec("fp8_e5m2", "token", 8),
    QuantSpec("fp8_e4m3", "head"),
    QuantSpec("fp8_e4m3", "tensor"),
    QuantSpec("fp8_e4m3", "token", scale_dtype="e8m0"),
    QuantSpec("int8", "token"),
] + [QuantSpec(f"int{b}", "token", 8, backend) for b in (4, 2) for backend in PACKING_BACKENDS]


def relative_bound(spec: QuantSpec) -> float:
    """Largest error relative to a group's largest magnitude: half a step of 2 * amax / (2^bits - 1) for integers
    (1/3 for int2), 2^-4 (E4M3) or 2^-3 (E5M2) for FP8."""
    if spec.is_int:
        return 1.0 / (2**spec.bits - 1) * 1.001
    return FP8[spec.format][1] * 1.001


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.format}-{s.granularity}-{s.backend}-{s.scale_dtype}")
def test_all_zero_and_tiny_inputs(spec):
    zeros = torch.zeros(1, 2, 3, 16)
    y, _ = roundtrip(spec, zeros)
    assert torch.equal(y, zeros)
    for magnitude in (1e-30, 1e-40):  # 1e-40 is a float32 subnormal
        x = torch.randn(1, 2, 3, 16) * magnitude
        y, _ = roundtrip(spec, x)
        assert torch.isfinite(y).all()
        if magnitude > 1e-38:  # normal float32: still quantized relative to its own magnitude
            assert ((y - x).abs() <= x.abs().amax() * relative_bound(spec)).all()
        else:  # subnormal: at most flushed (errors below the smallest normal float32)
            assert ((y - x).abs() <= torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.format}-{s.granularity}-{s.backend}-{s.scale_dtype}")
def test_huge_inputs_stay_finite(spec):
    x = torch.randn(1, 2, 3, 16) * 1e37
    x[0, 0, 0, 0] = 2.9e38  # near the float32 maximum (3.4e38)
    y, _ = roundtrip(spec, x)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= relative_bound(spec) * x.abs().amax(-1, keepdim=True)).all()


def test_power_of_two_scales_saturate_at_the_top_of_float32():
    x = torch.full((1, 1, 1, 16), 3.3e38)
    y, _ = roundtrip(QuantSpec("fp8_e4m3", "token", scale_dtype="e8m0"), x)
    assert torch.equal(y, torch.full_like(x, 448.0 * 2.0**119))  # the largest exponent kept (2^(e + 8) finite)


def test_values_beyond_a_static_scale_saturate():
    store = QuantizedStore(QuantSpec("fp8_e4m3", "tensor"), QuantSpec("fp8_e4m3", "head"))
    store.set_static(key_scale=1.0, value_scale=[0.5, 2.0])
    store.allocate(1, 2, 16, 4, torch.float32, "cpu")
    x = torch.full((1, 2, 1, 16), 1000.0)
    store.write(torch.zeros(1, 1, 1, dtype=torch.long), x, -x, start=0)
    k, v = store.read(1)
    assert torch.equal(k, torch.full_like(x, 448.0))  # fmax * scale
    assert torch.equal(v[0, 0], torch.full((1, 16), -224.0)) and torch.equal(v[0, 1], torch.full((1, 16), -896.0))


def test_float16_scales_saturate_beyond_their_range():
    spec = QuantSpec("int8", "token", scale_dtype="float16")
    x = torch.tensor([1e6, -1e6, 0.0, 1.0]).repeat(4).view(1, 1, 1, 16)
    y, _ = roundtrip(spec, x)
    assert torch.isfinite(y).all() and y.abs().max() <= 65504 * 256


@pytest.mark.parametrize("spec", ALL_SPECS[:3] + ALL_SPECS[-1:], ids=lambda s: f"{s.format}-{s.granularity}")
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("append_only", [False, True])
def test_non_finite_input_is_an_error_and_leaves_the_store_unchanged(spec, bad, append_only):
    store = QuantizedStore(spec, spec, append_only=append_only, residual=2 if append_only else 0, name="TestCache")
    store.layer_idx = 7
    store.allocate(1, 2, 16, 8, torch.float32, "cpu")
    x = torch.randn(1, 2, 3, 16)
    store.write(torch.arange(3).expand(1, 1, 3), x, x, start=0)
    before = [t.clone() for t in store.read(3)]
    nbytes = store.nbytes()
    y = torch.randn(1, 2, 1, 16)
    y[0, 1, 0, 5] = bad
    with pytest.raises(NonFiniteError, match=r"TestCache \(layer 7\): 1 non-finite values"):
        store.write(torch.full((1, 1, 1), 3), x[:, :, :1], y, start=3)
    with pytest.raises(FloatingPointError):  # also an ArithmeticError for callers that catch those
        store.write_slot(3, y, x[:, :, :1])
    after = store.read(3)
    assert store.nbytes() == nbytes
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(t).all() for t in after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "spec",
    [QuantSpec("fp8_e4m3"), QuantSpec("fp8_e4m3", "channel", 4), QuantSpec("int8", "token", 8)]
    + [QuantSpec("int4", "channel", 4, b) for b in PACKING_BACKENDS],
    ids=lambda s: f"{s.format}-{s.granularity}-{s.backend}",
)
def test_half_precision_models(spec, dtype):
    """Keys and values in bfloat16/float16: read back in that dtype, within the format's bound (plus the rounding
    of the output to the model's dtype), with smoothing and the full-precision residual in the same dtype."""
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 40, 16) * 3 + 1).to(dtype)
    store = QuantizedStore(spec, spec, append_only=True, residual=3, key_smoothing=True, workspace=DequantWorkspace())
    store.allocate(2, 3, 16, 41, dtype, "cpu")
    store.write(torch.arange(40).expand(2, 1, 40), x, x, start=0)
    k, v = store.read(40)
    assert k.dtype == v.dtype == dtype and store.qlen >= 32
    assert torch.equal(k[:, :, store.qlen :], x[:, :, store.qlen :])  # residual: exact
    xf, eps = x.float(), torch.finfo(dtype).eps
    step = 2 * xf.abs().amax() / (2**spec.bits - 1) if spec.is_int else 0.0
    # values: the format's bound, plus rounding the output to the model's dtype
    assert ((v.float() - xf).abs() <= relative_bound(spec) * xf.abs() + step + eps * xf.abs() + 1e-6).all()
    # keys were centred on their mean before quantizing and get it back after (in the model's dtype)
    centred, mean = (xf - store.key_mean).abs(), store.key_mean.abs()
    bound = relative_bound(spec) * centred + step + 2 * eps * (xf.abs() + mean) + 1e-6
    assert ((k.float() - xf).abs() <= bound).all()
