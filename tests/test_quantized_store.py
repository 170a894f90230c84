"""QuantizedStore layouts: append-only (residual, KIVI blocks, each token quantized exactly once) and slot layout
(arbitrary writes for evicting policies); bytes held versus the theoretical size; the shared workspace."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.stores.growing_layout import GROWTH_TOKENS
from hf_kvcache.stores.quantization import QuantSpec, backend_available
from hf_kvcache.stores.quantized import GROWTH, QuantizedStore
from hf_kvcache.stores.workspace import DequantWorkspace

PACKER = next((b for b in ("quanto", "hqq") if backend_available(b)), None)
needs_packer = pytest.mark.skipif(PACKER is None, reason="neither optimum-quanto nor hqq is installed")
B, H, D = 2, 3, 16


def kivi(bits=4, group=4, backend=None):
    backend = backend or PACKER
    return QuantSpec(f"int{bits}", "channel", group, backend), QuantSpec(f"int{bits}", "token", 8, backend)


def make(key, value, append_only=True, **kw) -> QuantizedStore:
    store = QuantizedStore(key, value, append_only=append_only, workspace=DequantWorkspace(), **kw)
    store.allocate(B, H, D, 17, torch.float32, "cpu")
    return store


def seq(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).expand(B, 1, n)


class EncodeCounter:
    """Counts the tokens each codec quantizes (through `encode` or its native `write_tokens`)."""

    def __init__(self, store):
        self.tokens = 0
        codec = store.keys_codec  # (with the same per-token spec, keys and values share one codec)
        original = codec.encode

        def counted(x):
            self.tokens += x.shape[2]
            return original(x)

        codec.encode = counted
        native = codec.write_tokens  # (FP8 on CPU: a decode step's tokens quantized natively, not through encode)

        def counted_native(keys, values, slot):
            written = native(keys, values, slot)
            if written:
                self.tokens += keys.shape[2]
            return written

        codec.write_tokens = counted_native


@needs_packer
@pytest.mark.parametrize("residual", [0, 3, 8])
def test_append_only_quantizes_each_token_once_and_never_again(residual):
    torch.manual_seed(0)
    store = make(*kivi(group=4), residual=residual)
    counter = EncodeCounter(store)
    x, y = torch.randn(B, H, 50, D), torch.randn(B, H, 50, D)
    store.write(seq(0, 13), x[:, :, :13], y[:, :, :13], start=0)  # prefill
    first_k, _ = (t.clone() for t in store.read(13))
    for t in range(13, 50):
        store.write_slot(t, x[:, :, t : t + 1], y[:, :, t : t + 1])
        n = t + 1
        # blocks of 4 leave full precision once `residual` newer tokens exist
        assert store.qlen == max(0, n - residual) // 4 * 4
        assert store.fp_len == n - store.qlen
        k, v = store.read(n)
        # the full-precision region is exact; quantized tokens read back the same at every step (no re-quantizing)
        assert torch.equal(k[:, :, store.qlen :], x[:, :, store.qlen : n])
        assert torch.equal(v[:, :, store.qlen :], y[:, :, store.qlen : n])
        settled = min(store.qlen, 13 - 13 % 4 if residual == 0 else store.qlen)
        if t == 49:
            final_k = k.clone()
    assert counter.tokens == store.qlen  # every quantized token was quantized exactly once
    # tokens quantized at prefill kept their values through 37 appends
    quantized_at_prefill = max(0, 13 - residual) // 4 * 4
    assert torch.equal(final_k[:, :, :quantized_at_prefill], first_k[:, :, :quantized_at_prefill])
    assert settled >= 0


def test_append_cost_is_proportional_to_new_tokens():
    """Work per append (tokens encoded) does not grow with the cache: 1 token per step for per-token FP8."""
    store = make(QuantSpec("fp8_e4m3"), QuantSpec("fp8_e4m3"))
    counter = EncodeCounter(store)
    store.write(seq(0, 64), torch.randn(B, H, 64, D), torch.randn(B, H, 64, D), start=0)
    for t in range(64, 200):
        before = counter.tokens
        store.write_slot(t, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        assert counter.tokens - before == 1


def test_slot_layout_arbitrary_and_per_head_writes():
    torch.manual_seed(1)
    spec = QuantSpec("fp8_e4m3", "token")
    store = make(spec, QuantSpec("int8"), append_only=False)
    ref = make(spec, QuantSpec("int8"), append_only=False)
    x, y = torch.randn(B, H, 16, D), torch.randn(B, H, 16, D)
    store.write(seq(0, 16), x, y, start=0)
    # overwrite slots in a scattered order, a different slot per row and per head (H2O-style), the trash slot too
    dest = torch.tensor([[[3, 16, 7], [0, 9, 16], [15, 2, 4]], [[5, 6, 16], [1, 16, 11], [8, 12, 13]]])
    nx, ny = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    store.write(dest, nx, ny)
    expected_x, expected_y = x.clone(), y.clone()
    for b in range(B):
        for h in range(H):
            for i in range(3):
                if dest[b, h, i] < 16:
                    expected_x[b, h, dest[b, h, i]] = nx[b, h, i]
                    expected_y[b, h, dest[b, h, i]] = ny[b, h, i]
    ref.write(seq(0, 16), expected_x, expected_y, start=0)  # per-token scales: a token's codes depend on itself only
    k, v = store.read(16)
    rk, rv = ref.read(16)
    assert torch.equal(k, rk) and torch.equal(v, rv)
    assert ((k - expected_x).abs() <= expected_x.abs() * 2**-4 + 1e-3).all()
    # read_slots gathers copies
    sk, sv = store.read_slots(torch.tensor([[[2, 0]], [[5, 5]]]))
    assert torch.equal(sk[0, :, 0], k[0, :, 2]) and torch.equal(sv[1, :, 1], v[1, :, 5])
    # re-rotated sinks: keys of slots [0, 2) rewritten in place
    new_sinks = torch.randn(B, H, 2, D)
    store.write_keys_slice(0, new_sinks)
    k2, v2 = store.read(16)
    assert ((k2[:, :, :2] - new_sinks).abs() <= new_sinks.abs() * 2**-4 + 1e-3).all()
    assert torch.equal(k2[:, :, 2:], k[:, :, 2:]) and torch.equal(v2, v)


def test_slot_layout_rejects_block_granularity_and_residual():
    with pytest.raises(ValueError, match=r"granularity 'channel' .* needs the append-only keep-all layout"):
        QuantizedStore(QuantSpec("fp8_e4m3", "channel", 4), "fp8_e4m3", append_only=False)
    with pytest.raises(ValueError, match=r"residual window \(residual=8\) needs the append-only"):
        QuantizedStore("fp8_e4m3", "fp8_e4m3", residual=8)


def test_append_only_rejects_an_evicting_write_pattern():
    store = make(QuantSpec("fp8_e4m3", "channel", 4), QuantSpec("fp8_e4m3"))
    store.write(seq(0, 8), torch.randn(B, H, 8, D), torch.randn(B, H, 8, D), start=0)
    ring = torch.tensor([[[8, 2]], [[8, 2]]])  # a ring buffer wrapping around (sliding-window policy)
    with pytest.raises(RuntimeError, match=r"append-only layout needs sequential writes.*append_only=False"):
        store.write(ring, torch.randn(B, H, 2, D), torch.randn(B, H, 2, D))


@needs_packer
def test_crop_within_the_residual_and_at_block_boundaries():
    store = make(*kivi(group=4), residual=4)
    x, y = torch.randn(B, H, 20, D), torch.randn(B, H, 20, D)
    store.write(seq(0, 20), x, y, start=0)  # 16 quantized + 4 in full precision
    assert (store.qlen, store.fp_len) == (16, 4)
    store.write_slot(18, x[:, :, 18:19] * 0, y[:, :, 18:19] * 0)  # assisted decoding rejected 2 tokens
    assert store.length == 19
    k, _ = store.read(19)
    assert torch.equal(k[:, :, 16:18], x[:, :, 16:18]) and torch.equal(k[:, :, 18], torch.zeros_like(k[:, :, 18]))
    keys_12, _ = store.read(12)  # a crop to a block boundary inside the quantized region is exact
    assert store.length == 12 and keys_12.shape[2] == 12
    with pytest.raises(NotImplementedError, match=r"cannot crop to 10 tokens.*blocks of 4 and cannot be split"):
        store.read(10)


def test_map_batch_reorders_rows():
    store = make(QuantSpec("fp8_e4m3", "channel", 4), QuantSpec("fp8_e5m2"), residual=3)
    x, y = torch.randn(B, H, 11, D), torch.randn(B, H, 11, D)
    store.write(seq(0, 11), x, y, start=0)
    k, v = (t.clone() for t in store.read(11))
    beam = torch.tensor([1, 1])
    store.map_batch(lambda t: t.index_select(0, beam))
    k2, v2 = store.read(11)
    assert torch.equal(k2, k[beam]) and torch.equal(v2, v[beam])
    store.map_batch(lambda t: t.repeat_interleave(2, dim=0))
    assert store.read(11)[0].shape[0] == 4


# -- bytes -------------------------------------------------------------------------------------------------------
def theoretical(tokens: int, key: QuantSpec, value: QuantSpec, model_bytes: int, residual_slots: int = 0) -> float:
    """values x bits / 8 + scales and zero points + residual window, from first principles, per (batch row, head)."""
    total = 0.0
    for spec in (key, value):
        if spec.format == "none":
            total += tokens * D * model_bytes
            continue
        total += tokens * D * spec.bits / 8
        if spec.is_fp8:
            scale_bytes = 1 if spec.scale_dtype == "e8m0" else (4 if spec.scale_dtype == "float32" else 2)
            groups = D // (spec.group_size or D) if spec.granularity == "token" else D / spec.group_size
            total += tokens * groups * scale_bytes
        else:
            scale_bytes = (
                model_bytes
                if spec.scale_dtype is None
                else {"float16": 2, "bfloat16": 2, "float32": 4}[spec.scale_dtype]
            )
            groups = D // (spec.group_size or D) if spec.granularity == "token" else D / spec.group_size
            total += tokens * groups * 2 * scale_bytes  # scale and zero point
    total += 2 * residual_slots * D * model_bytes
    return total * B * H


SPECS = [
    (QuantSpec("fp8_e4m3"), QuantSpec("fp8_e4m3"), 0),
    (QuantSpec("fp8_e5m2", "token", 8, scale_dtype="e8m0"), QuantSpec("fp8_e4m3", scale_dtype="float32"), 5),
    (QuantSpec("int8", "token", 8), QuantSpec("fp8_e4m3", "channel", 4), 0),
    (QuantSpec("fp8_e4m3", "channel", 4), QuantSpec("none"), 0),
]
if PACKER:
    SPECS += [
        (*kivi(4, 4), 6),
        (*kivi(2, 8), 0),
        (QuantSpec("int4", "token", 8, PACKER, "float16"), QuantSpec("int2", "token", 4, PACKER), 3),
    ]


@pytest.mark.parametrize(
    "key, value, residual", SPECS, ids=lambda v: str(v) if isinstance(v, int) else f"{v.format}-{v.granularity}"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nbytes_is_the_theoretical_size(key, value, residual, dtype):
    store = QuantizedStore(key, value, residual=residual, append_only=True)
    store.allocate(B, H, D, 17, dtype, "cpu")
    n = 200
    store.write(seq(0, n), torch.randn(B, H, n, D, dtype=dtype), torch.randn(B, H, n, D, dtype=dtype), start=0)
    model_bytes = torch.empty((), dtype=dtype).element_size()
    fp_slots = store.fp_k.shape[2] if store.fp_k is not None else 0
    assert fp_slots == (residual + store.flush - 1 if residual + store.flush > 1 else 0)
    # one prefill: physical capacity is exactly the quantized tokens
    assert store.keys_codec.capacity == store.qlen
    expected = theoretical(store.qlen, key, value, model_bytes, fp_slots)
    assert abs(store.nbytes() - expected) <= 0.01 * expected
    # decoding grows the buffers by GROWTH (1/256) at a time, at least GROWTH_TOKENS or one flush: bytes held stay
    # within that of the content
    for t in range(n, n + 150):
        store.write_slot(t, torch.randn(B, H, 1, D, dtype=dtype), torch.randn(B, H, 1, D, dtype=dtype))
        capacity = store.keys_codec.capacity
        assert store.qlen <= capacity <= store.qlen * (1 + GROWTH) + max(store.flush, GROWTH_TOKENS)
        expected = theoretical(capacity, key, value, model_bytes, fp_slots)
        assert abs(store.nbytes() - expected) <= 0.01 * expected


@needs_packer
def test_4k_tokens_bytes_versus_dynamic_cache_in_bfloat16():
    """At 4K tokens: FP8 (per-token scales) <= 0.52x, INT4 group 64 <= 0.30x of a bfloat16 DynamicCache (keys and
    values of the same shape), counting every byte the store holds (its residual buffer included)."""
    heads, dim, n = 3, 64, 4096
    dynamic = 2 * heads * n * dim * 2
    x = torch.randn(1, heads, n, dim, dtype=torch.bfloat16)
    fp8 = QuantizedStore(QuantSpec("fp8_e4m3"), QuantSpec("fp8_e4m3"), append_only=True)
    int4 = QuantizedStore(
        QuantSpec("int4", "channel", 64, PACKER), QuantSpec("int4", "token", 64, PACKER), append_only=True
    )
    ratios = {}
    for name, store in (("fp8", fp8), ("int4", int4)):
        store.allocate(1, heads, dim, 17, torch.bfloat16, "cpu")
        store.write(torch.arange(n).view(1, 1, n), x, x, start=0)
        ratios[name] = store.nbytes() / dynamic
    assert ratios["fp8"] <= 0.52, ratios
    assert ratios["int4"] <= 0.30, ratios


def test_workspace_is_reused_and_sized_for_one_layer():
    workspace = DequantWorkspace()
    stores = [QuantizedStore("fp8_e4m3", "fp8_e4m3", append_only=True, workspace=workspace) for _ in range(4)]
    pointers = set()
    for i, store in enumerate(stores):
        store.allocate(B, H, D, 17, torch.float32, "cpu")
        n = 43 - i  # the first read sizes the buffers; later (smaller) reads reuse them
        store.write(seq(0, n), torch.randn(B, H, n, D), torch.randn(B, H, n, D), start=0)
        k, v = store.read(n)
        pointers.add((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
    assert len(pointers) == 1  # every layer dequantizes into the same buffers
    one_layer = 2 * B * H * 43 * D * 4
    scratch = 2 * B * H * 43 * D * 2  # FP8 bits -> float16 conversion (keys and values)
    assert workspace.nbytes() <= 2 * (one_layer + scratch)


@pytest.mark.parametrize(
    "key,value,smoothing",
    [
        (QuantSpec("fp8_e4m3", "token"), QuantSpec("fp8_e4m3", "token"), False),  # joint codec
        (
            QuantSpec("fp8_e4m3", "token", 8),
            QuantSpec("fp8_e4m3", "token", 8),
            True,
        ),  # joint, channel groups, smoothing
        (QuantSpec("fp8_e5m2", "head"), QuantSpec("int8", "token"), True),
        pytest.param(
            QuantSpec("int4", "token", 8, PACKER or "torch"),
            QuantSpec("int2", "token", 16, PACKER or "torch"),
            False,
            marks=needs_packer,
        ),
    ],
)
def test_read_slots_dequantizes_only_the_slots_asked_for(key, value, smoothing):
    """read_slots (CompositeCache moves) equals the gathered full read, per row and per head."""
    torch.manual_seed(2)
    store = make(key, value, append_only=False, key_smoothing=smoothing)
    store.write(seq(0, 16), torch.randn(B, H, 16, D) * 3 + 1, torch.randn(B, H, 16, D), start=0)
    k, v = store.read(17)
    k, v = k.clone(), v.clone()
    for slots in (torch.tensor([[[2, 0, 15]], [[5, 5, 16]]]), torch.randint(0, 17, (B, H, 4))):
        sk, sv = store.read_slots(slots)
        index = slots[..., None].expand(B, H, slots.shape[-1], D)
        assert torch.equal(sk, k.gather(2, index)) and torch.equal(sv, v.gather(2, index))
