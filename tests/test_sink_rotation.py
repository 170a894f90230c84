"""The sinks' in-place re-rotation (SinkMemory._rotate_into, used when the store exposes `key_slots`, i.e. the
composite's full-precision sinks region) against `KeyRotator.rotate` (the path SinkCache keeps): same keys for both
RoPE conventions, partial rotary dims, per-row and per-head targets, rows with no other token, and 16-bit dtypes."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model

from hf_kvcache.common.rope import KeyRotator, LayerRope
from hf_kvcache.layers.slot_view import LayerSlotView
from hf_kvcache.policies.sinks import SinkMemory
from hf_kvcache.stores import FullPrecisionStore
from hf_kvcache.stores.regions import RegionStore

SINKS, HEADS, HEAD_DIM, BATCH = 3, 2, 16, 2


class _Layer:
    def __init__(self, store, layer_idx=0):
        self.store, self.layer_idx = store, layer_idx


def _view(store):
    """What the policy is given of a layer holding `store` (its key writes are all the rotation uses)."""
    return LayerSlotView(_Layer(store))


def _memory(rotator, keys, positions):
    memory = SinkMemory(SINKS, rotator)
    memory.allocate(BATCH, "cpu")
    memory.keys = torch.zeros(BATCH, HEADS, SINKS + 1, HEAD_DIM, dtype=keys.dtype)
    memory.keys[:, :, :SINKS] = keys
    memory.pos[:, :SINKS] = positions
    return memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_row", "per_head"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("convention", ["half", "interleaved"])
def test_in_place_rotation_equals_the_rotator(convention, rotary_dim, per_head, dtype):
    rotator = KeyRotator(build_model("llama").config, parameter="sink_positions")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    rotator.layers[0] = LayerRope(inv_freq, convention)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(BATCH, HEADS, SINKS, HEAD_DIM, generator=gen).to(dtype)
    positions = torch.tensor([[0, 1, 2], [5, 6, 9]])  # row 1: left padding moved its sinks' positions
    shape = (BATCH, HEADS) if per_head else (BATCH,)
    oldest = torch.randint(10, 5000, shape, generator=gen)
    has_other = torch.ones(shape, dtype=torch.bool)
    has_other[0] = False  # row 0 holds only sinks: they keep their original positions

    regions = RegionStore([SINKS, 8], [FullPrecisionStore(), FullPrecisionStore()])
    regions.allocate(BATCH, HEADS, HEAD_DIM, SINKS + 8 + 1, dtype, "cpu")
    plain = FullPrecisionStore()  # no key_slots: KeyRotator.rotate + write_keys_slice
    plain.allocate(BATCH, HEADS, HEAD_DIM, SINKS + 1, dtype, "cpu")
    for store in (regions.stores[0], plain):
        store.keys[:, :, :SINKS] = keys
    _memory(rotator, keys, positions).reposition_before(_view(regions), oldest, has_other)
    _memory(rotator, keys, positions).reposition_before(_view(plain), oldest, has_other)

    got, want = regions.stores[0].keys[:, :, :SINKS], plain.keys[:, :, :SINKS]
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # one bf16 rounding either way
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(got[0], keys[0], rtol=0, atol=0)  # no other token: unchanged
    torch.testing.assert_close(got[..., rotary_dim:], keys[..., rotary_dim:], rtol=0, atol=0)  # not rotary
    assert not torch.equal(got[1], keys[1])  # row 1 did move (else this compares nothing)


def test_quantized_sinks_region_offers_no_key_slots():
    """A sinks region in FP8 cannot be rotated in place: `key_slots` says so and the rotator path is taken."""
    from hf_kvcache.stores.regions import store_for_precisions

    regions = RegionStore([SINKS, 8], [store_for_precisions("fp8_e4m3", "fp8_e4m3"), FullPrecisionStore()])
    regions.allocate(1, HEADS, HEAD_DIM, SINKS + 8 + 1, torch.float32, "cpu")
    assert regions.key_slots(0, SINKS) is None
    assert regions.key_slots(SINKS, 8).shape == (1, HEADS, 8, HEAD_DIM)
    assert regions.key_slots(SINKS - 1, 2) is None  # across two regions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_row", "per_head"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("convention", ["half", "interleaved"])
def test_native_in_place_rotation_equals_the_torch_one(convention, rotary_dim, per_head, dtype, monkeypatch):
    """On CPU the in-place rotation is one native call (hf_kvcache.kernels.cpu_rope); it writes what the torch ops
    of `_rotate_into` write (float32 arithmetic; cos / sin may differ in the last bit), leaves rows with no other
    token and the non-rotary dims as they are, and is really taken (counted)."""
    from hf_kvcache.kernels import cpu_blockwise, cpu_rope
    from hf_kvcache.policies import sinks

    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    rotator = KeyRotator(build_model("llama").config, parameter="sink_positions")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    rotator.layers[0] = LayerRope(inv_freq, convention)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(BATCH, HEADS, SINKS, HEAD_DIM, generator=gen).to(dtype)
    positions = torch.tensor([[0, 1, 2], [5, 6, 9]])
    shape = (BATCH, HEADS) if per_head else (BATCH,)
    oldest = torch.randint(10, 50000, shape, generator=gen)
    if per_head:  # (the padded path finds the oldest positions per head in the int32 slot positions)
        oldest = oldest.int()
    has_other = torch.ones(shape, dtype=torch.bool)
    has_other[0] = False
    results, calls = [], []

    def counted(*args):
        calls.append(True)
        return cpu_rope.rotate_sinks_into(*args)

    for native in (counted, lambda *args: False):  # the native call, then the torch ops
        monkeypatch.setattr(sinks, "rotate_sinks_into", native)
        regions = RegionStore([SINKS, 8], [FullPrecisionStore(), FullPrecisionStore()])
        regions.allocate(BATCH, HEADS, HEAD_DIM, SINKS + 8 + 1, dtype, "cpu")
        regions.stores[0].keys[:, :, :SINKS] = keys
        _memory(rotator, keys, positions).reposition_before(_view(regions), oldest, has_other)
        results.append(regions.stores[0].keys[:, :, :SINKS].clone())
    native, torch_ops = results
    assert calls == [True]
    torch.testing.assert_close(
        native.float(), torch_ops.float(), **({} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2))
    )  # (16-bit: one rounding either side)
    torch.testing.assert_close(native[0], keys[0], rtol=0, atol=0)  # no other token: unchanged
    torch.testing.assert_close(native[..., rotary_dim:], keys[..., rotary_dim:], rtol=0, atol=0)
    assert not torch.equal(native[1], keys[1])


def test_native_rotation_refuses_a_wrong_shape():
    """The native call checks its shapes: a `shift` for another number of sinks is an error naming it, never a read
    out of bounds."""
    from hf_kvcache.kernels import cpu_blockwise, cpu_rope

    if cpu_blockwise.unavailable():
        pytest.skip(cpu_blockwise.unavailable())
    keys = torch.randn(1, HEADS, SINKS + 1, HEAD_DIM)
    target = torch.zeros(1, HEADS, SINKS, HEAD_DIM)
    oldest = torch.tensor([[40]])
    with pytest.raises(RuntimeError, match="shift"):
        cpu_rope.rotate_sinks_into(
            keys,
            target,
            oldest,
            torch.zeros(1, 1, SINKS + 2, dtype=torch.long),
            None,
            torch.ones(HEAD_DIM // 2),
            "half",
        )
