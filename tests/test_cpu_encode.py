"""The native FP8 write of a decode step's tokens (hf_kvcache.kernels.cpu_encode) is bit for bit the torch path
(`FP8Codec.encode` + `put`): every format, scale dtype, channel group and input dtype, magnitudes from 1e-30 to 1e5,
exact ties; non-finite input writes nothing; an FP8 cache decodes the same tokens with and without it."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_kvcache.kernels import cpu_blockwise, cpu_encode
from hf_kvcache.stores.fp8 import FP8Codec
from hf_kvcache.stores.quantization import NonFiniteError, QuantSpec

pytestmark = pytest.mark.skipif(
    cpu_blockwise.unavailable() is not None, reason="the native CPU kernel does not build here"
)


def _codec(
    fmt: str,
    scale_dtype: str | None = None,
    group: int | None = None,
    batch: int = 2,
    heads: int = 3,
    capacity: int = 8,
) -> FP8Codec:
    codec = FP8Codec(
        QuantSpec.from_value({"format": fmt, "granularity": "token", "group_size": group, "scale_dtype": scale_dtype})
    )
    codec.allocate(2 * batch, heads, 64, capacity, torch.float32, "cpu")
    return codec


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize(
    "fmt,scale_dtype,group,dtype",
    itertools.product(
        ["fp8_e4m3", "fp8_e5m2"], ["bfloat16", "float16", "float32"], [None, 16], [torch.float32, torch.bfloat16]
    ),
)
def test_native_write_is_the_torch_path_bit_for_bit(fmt, scale_dtype, group, dtype):
    codec = _codec(fmt, scale_dtype, group)
    for seed in range(24):
        gen = torch.Generator().manual_seed(seed)
        magnitude = 10.0 ** torch.empty(1).uniform_(-30, 5, generator=gen).item()
        keys = (torch.randn(2, 3, 1, 64, generator=gen) * magnitude).to(dtype)
        values = (torch.randn(2, 3, 1, 64, generator=gen) * magnitude).to(dtype)
        keys[0, 1] = 0  # an all-zero group: the smallest scale of the dtype
        expected = codec.encode(torch.cat((keys, values), 0))
        assert codec.write_tokens(keys, values, 5) is True
        assert _same_bits(codec.slot["data"][:, :, 5:6], expected["data"]), (seed, magnitude)
        assert _same_bits(codec.slot["scale"][:, :, 5:6], expected["scale"]), (seed, magnitude)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_native_write_rounds_exact_ties_as_torch_does(fmt):
    """Every midpoint between two neighbouring FP8 values (round to nearest even decides) lands on the same code."""
    codec = _codec(fmt, batch=1, heads=1, capacity=2)
    levels = torch.arange(256, dtype=torch.uint8).view(codec.fp8_dtype).float()
    levels = levels[torch.isfinite(levels)].unique().sort().values
    middles = (levels[:-1] + levels[1:]) / 2
    middles = middles[middles.abs() < codec.fmax]
    anchor = torch.zeros(1, 1, 1, 64)
    anchor[..., 0] = 3.0  # fixes the scale; the other 63 channels are midpoints times it
    scale = codec.encode(torch.cat((anchor, anchor), 0))["scale"][0, 0, 0, 0].float()
    for first in range(0, len(middles), 63):
        chunk = middles[first : first + 63]
        x = anchor.clone()
        x[0, 0, 0, 1 : 1 + len(chunk)] = chunk * scale
        assert torch.equal(x[0, 0, 0, 1 : 1 + len(chunk)] / scale, chunk)  # the ties survive the division
        expected = codec.encode(torch.cat((x, x), 0))
        assert codec.write_tokens(x, x, 0) is True
        assert torch.equal(codec.slot["data"][:, :, :1], expected["data"])


def test_non_finite_input_writes_nothing():
    codec = _codec("fp8_e4m3")
    before = {name: t.clone() for name, t in codec.slot.items()}
    keys, values = torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64)
    values[1, 2, 0, 7] = float("nan")
    assert codec.write_tokens(keys, values, 3) is False
    assert all(torch.equal(codec.slot[name], t) for name, t in before.items())


def test_outside_the_native_layouts_says_none():
    pow2 = FP8Codec(QuantSpec.from_value({"format": "fp8_e4m3", "granularity": "token", "scale_dtype": "e8m0"}))
    pow2.allocate(2, 1, 64, 4, torch.float32, "cpu")
    assert pow2.write_tokens(torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64), 0) is None
    data, scale = torch.zeros(1, 1, 1, 64, dtype=torch.uint8), torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)
    assert "CPU" in cpu_encode.unsupported(torch.zeros(1, 1, 1, 64, device="meta"), data, scale)
    assert "scales" in cpu_encode.unsupported(torch.zeros(1, 1, 1, 64), data, scale.to(torch.int8))


def test_fp8_cache_decodes_the_same_with_and_without_the_native_write(monkeypatch):
    """Greedy decode of a tiny Llama through an FP8 cache (per-token scales, the native write in every decode step)
    equals the same decode with the torch path, token for token and logit for logit; a NaN key then raises
    NonFiniteError and leaves the cache as it was."""
    from model_zoo import llama

    from hf_kvcache import QuantizedFP8Cache, cache_kwargs

    model = llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    native = FP8Codec.write_tokens

    def counted(self, *args):
        calls.append(1)
        return native(self, *args)

    def decode():
        cache = QuantizedFP8Cache(model)
        with torch.inference_mode():
            out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            logits = [out.logits[:, -1]]
            for _ in range(6):
                token = logits[-1].argmax(-1, keepdim=True)
                logits.append(model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1])
        return torch.stack(logits), cache

    monkeypatch.setattr(FP8Codec, "write_tokens", counted)
    with_native, cache = decode()
    assert calls, "the decode steps never reached the native write"
    monkeypatch.setattr(FP8Codec, "write_tokens", lambda self, *args: None)
    without, _ = decode()
    assert torch.equal(with_native, without)

    monkeypatch.setattr(FP8Codec, "write_tokens", native)
    layer = cache.layers[0]
    state = (layer.seen, layer.store.qlen, layer.store.keys_codec.slot["data"].clone())
    keys = torch.randn(2, layer.heads, 1, layer.head_dim)
    keys[0, 0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="non-finite keys"):
        layer.store.write_slot(layer.store.length, keys, torch.randn_like(keys))
    assert (layer.seen, layer.store.qlen) == state[:2] and torch.equal(layer.store.keys_codec.slot["data"], state[2])


def test_finite_check_of_a_decode_step_is_native_and_agrees_with_torch():
    """`tensors_finite` (the stores' check for a decode step's numbers on CPU) says what torch.isfinite says, for
    every float dtype, non-contiguous views and a NaN / inf in keys or values; it leaves large or non-CPU inputs
    to torch (None)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        keys = torch.randn(2, 3, 1, 64, generator=gen).to(dtype)
        values = torch.randn(2, 3, 1, 64, generator=gen).to(dtype)
        assert cpu_encode.tensors_finite(keys, values) is True
        assert cpu_encode.tensors_finite(keys.transpose(1, 3), None) is True
        for bad in (float("nan"), float("inf"), -float("inf")):
            for which in ("keys", "values"):
                k, v = keys.clone(), values.clone()
                (k if which == "keys" else v)[1, 2, 0, 63] = bad
                assert cpu_encode.tensors_finite(k, v) is False, (dtype, bad, which)
    big = torch.zeros(cpu_encode.FINITE_NATIVE_MAX + 1)
    assert cpu_encode.tensors_finite(big, None) is None
    assert cpu_encode.tensors_finite(torch.zeros(4, device="meta"), None) is None
