"""The quantized caches' `attention` option: attention straight from the codes (hf_kvcache.layers.codes_read) equals
the dequantize path (prefill, chunks, decode, padding, generate), never fills the dequantization workspace, and
refuses what it cannot do (a model that transforms the cached keys, a model not on the bridge, bad settings)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, left_pad, random_ids
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import KIVICache, QuantizedFP8Cache, cache_kwargs, returned_cache
from hf_kvcache.attention.codes import attend
from hf_kvcache.kernels import dequantize
from hf_kvcache.layers.codes_read import codes_now, resolve_attention
from hf_kvcache.stores.code_views import store_segments
from hf_kvcache.stores.full import FullPrecisionStore
from hf_kvcache.stores.quantization import backend_available
from hf_kvcache.stores.quantized import QuantizedStore
from hf_kvcache.stores.regions import RegionStore

KIVI_BACKENDS = [b for b in ("quanto", "hqq") if backend_available(b)]  # int4 packing (torch: int8 only)


def tiny_llama(**overrides):
    # initializer_range 0.1: float32 noise (SDPA vs eager on the same cache) stays ~5e-6 in the logits, while FP8
    # changes them by ~0.3 (with the conftest default 0.2 SDPA and eager alone differ by 5e-4)
    return build_model(
        "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, **overrides
    )  # head_dim 32


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def run(model, cache, ids, chunks=(24, 16)):
    """Prefill in `chunks` (multi-token forwards), then one token per forward: logits [B, steps, vocab]."""
    hf_kvcache.enable(model)
    out, t = [], 0
    with torch.no_grad():
        for c in chunks:
            out.append(model(input_ids=ids[:, t : t + c], **cache_kwargs(cache), use_cache=True).logits)
            t += c
        for i in range(t, ids.shape[1]):
            out.append(model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits)
    return torch.cat(out, 1)


@pytest.fixture(autouse=True, params=["torch", "native"])
def kernel(request, monkeypatch):
    """Every test on both CPU kernels of blockwise attention: the torch block walk and the native one ("auto" on
    CPU; HF_KVCACHE_NATIVE=0 turns it off)."""
    if request.param == "torch":
        monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    return request.param


def assert_same_attention(model, make, ids, atol=1e-4, chunks=(24, 16), kernel="torch"):
    reference_cache, cache = make("dequantize"), make("blockwise")
    reference = run(model, reference_cache, ids, chunks)
    logits = run(model, cache, ids, chunks)
    if kernel == "torch":  # the same matmuls in the same order as SDPA on the dequantized copy
        torch.testing.assert_close(logits, reference, atol=atol, rtol=0)
    else:
        # the native kernel sums in another order (attention within 1e-6, tests/test_blockwise_attention.py); with
        # every token quantized at once (no residual) a 1e-6 change in a layer's output can move a later key across
        # an FP8 rounding boundary (one code, 2^-4 of its value), ~1e-3 in the logits: bounded, and rare
        error = (logits - reference).abs()
        assert error.max() < 5e-3, float(error.max())
        assert (error > atol).float().mean() < 0.1, float((error > atol).float().mean())
    assert all(layer.attention_from_codes for layer in cache.layers)
    assert not any(layer.attention_from_codes for layer in reference_cache.layers)
    # the block-wise path never dequantizes a layer into the shared workspace; the dequantize path does
    assert cache.workspace_nbytes() == 0
    assert reference_cache.workspace_nbytes() > 0
    return cache


@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("residual", [0, 12])
@pytest.mark.parametrize("key_rotation", ["hadamard", "none"])
def test_fp8_blockwise_equals_dequantize(llama, granularity, residual, key_rotation, kernel):
    ids = random_ids(2, 56, seed=3)
    cache = assert_same_attention(
        llama,
        lambda a: QuantizedFP8Cache(
            llama, granularity=granularity, residual=residual, key_rotation=key_rotation, attention=a
        ),
        ids,
        kernel=kernel,
    )
    store = cache.layers[0].store
    assert store.qlen > 0 and residual <= store.fp_len < residual + store.flush
    assert (cache.layers[0].key_rotation is not None) == (key_rotation == "hadamard")


@pytest.mark.parametrize("backend", KIVI_BACKENDS)
def test_kivi_int4_with_residual_equals_dequantize(llama, backend):
    # The two paths attend within ~3e-6 of each other from the second chunk on. A block quantized after that encodes
    # slightly different keys: quanto's min-max codes stay the same, but hqq's iterative zero-point optimizer can pick
    # other codes (1e-2 in the logits; seen on an AVX-512 FP16 CPU). hqq stops at token 43, where the first block
    # quantized after the paths diverge (fixed by the counts: residual 12, blocks of 8) is first attended.
    ids = random_ids(1, 72 if backend == "quanto" else 43, seed=5)
    cache = assert_same_attention(
        llama,
        lambda a: KIVICache(llama, bits=4, group_size=8, residual=12, backend=backend, attention=a),
        ids,
        chunks=(20, 13),
    )
    store = cache.layers[0].store
    keys, _values = store.segments(store.length)
    assert keys[0].format == "int4" and keys[0].granularity == "channel" and keys[-1].format == "none"
    assert store.qlen % 8 == 0 and 12 <= store.fp_len < 12 + store.flush


def test_fixed_capacity_store(llama):
    """max_length: every slot is read in decode (the unwritten ones masked); the segments cover them all too."""
    ids = random_ids(2, 50, seed=2)
    cache = assert_same_attention(llama, lambda a: QuantizedFP8Cache(llama, max_length=64, attention=a), ids)
    assert cache.layers[0].store.segments(65)[0][0].length == 65


def test_key_smoothing_and_int8_keys(llama):
    """Smoothed keys (a key-mean bias on the key segment) and keys and values in different formats (two codecs)."""
    ids = random_ids(1, 50, seed=9)
    assert_same_attention(
        llama,
        lambda a: QuantizedFP8Cache(
            llama, key={"format": "int8"}, residual=4, key_smoothing=True, key_rotation="none", attention=a
        ),
        ids,
    )


def test_left_padding_and_greedy_generate(llama):
    """Batched, left-padded greedy generation: the same tokens and logits within 1e-4 (float32)."""
    hf_kvcache.enable(llama)
    ids, mask = left_pad([random_ids(1, 30, seed=1)[0], random_ids(1, 19, seed=2)[0], random_ids(1, 25, seed=4)[0]])
    outs = {}
    for attention in ("dequantize", "blockwise"):
        outs[attention] = llama.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=20,
            do_sample=False,
            cache_implementation="fp8",
            cache_config={"residual": 8, "attention": attention},
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert torch.equal(outs["blockwise"].sequences, outs["dequantize"].sequences)
    torch.testing.assert_close(
        torch.stack(outs["blockwise"].logits), torch.stack(outs["dequantize"].logits), atol=1e-4, rtol=0
    )
    cache = returned_cache(outs["blockwise"])
    assert cache.layers[0].attention_from_codes and cache.workspace_nbytes() == 0


@pytest.mark.parametrize("backend", KIVI_BACKENDS[:1])
def test_kivi_generate_equals_dequantize(llama, backend):
    hf_kvcache.enable(llama)
    ids = random_ids(1, 45, seed=11)
    outs = [
        llama.generate(
            input_ids=ids,
            max_new_tokens=24,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **cache_kwargs(KIVICache(llama, group_size=8, residual=8, backend=backend, attention=a)),
        )
        for a in ("dequantize", "blockwise")
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[1].logits), torch.stack(outs[0].logits), atol=1e-4, rtol=0)


def test_bf16_smoke():
    model = tiny_llama().to(torch.bfloat16)
    ids = random_ids(1, 40, seed=6)
    ref = run(model, QuantizedFP8Cache(model, residual=4, attention="dequantize"), ids)
    cache = QuantizedFP8Cache(model, residual=4, attention="blockwise")
    logits = run(model, cache, ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    # float32 softmax over bf16 codes vs bf16 SDPA: bf16-level differences only
    assert (logits.float() - ref.float()).abs().max() < 0.1 * ref.float().abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_decode_returns_stand_ins_and_no_workspace(llama):
    """During a decode step the layer hands attention zero-stride stand-ins (one element of storage), and the shared
    workspace stays empty, while the dequantize path holds a whole layer there."""
    ids = random_ids(1, 300, seed=8)
    caches = {a: QuantizedFP8Cache(llama, residual=16, attention=a) for a in ("blockwise", "dequantize")}
    for cache in caches.values():
        run(llama, cache, ids, chunks=(299,))
    layer = caches["blockwise"].layers[1]
    seen = {}
    original = layer.update

    def spy(k, v, *args, **kwargs):
        seen["kv"] = original(k, v, *args, **kwargs)
        return seen["kv"]

    layer.update = spy
    try:
        run(llama, caches["blockwise"], random_ids(1, 1, seed=2), chunks=())
    finally:
        del layer.update
    keys, values = seen["kv"]
    assert keys.shape == (1, 2, 301, 32) and values.shape == (1, 2, 301, 32)  # 300 tokens + this step's
    assert keys.stride() == (0, 0, 0, 0) and keys.untyped_storage().nbytes() == 4
    assert layer.codes_read is None  # the bridge consumed (and dropped) the segments
    assert caches["blockwise"].workspace_nbytes() == 0
    one_layer = 2 * 1 * 2 * 300 * 32 * 4  # keys + values of one layer, float32
    assert caches["dequantize"].workspace_nbytes() >= one_layer


def test_latent_attention_is_refused_by_name():
    """DeepSeek-V3 (MLA) expands the cached latent before attention: 'blockwise' raises naming the attention class,
    'auto' dequantizes."""
    from test_hybrid_layers import deepseek_v3

    model = deepseek_v3()
    hf_kvcache.enable(model)
    ids = random_ids(1, 10)
    with pytest.raises(RuntimeError, match=r"DeepseekV3Attention.*attention='dequantize'"):
        model(ids, **cache_kwargs(QuantizedFP8Cache(model, attention="blockwise")))
    cache = QuantizedFP8Cache(model, attention="auto")
    assert cache.layers[0].attention == "dequantize"
    logits = model(ids, **cache_kwargs(cache)).logits
    reference = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
    assert torch.allclose(logits, reference, atol=0.1)


def test_a_model_that_regroups_its_values_reads_them_dequantized():
    """DiffLlama regroups the cached values after the cache's update, so attention never gets them as they are: the
    first prefill shows it (the bridge compares what attention receives with what the update handed out), "auto" and
    the eviction caches' native route then read dequantized keys and values from that layer on (before, the first
    decode step raised), and an explicit 'blockwise' raises naming the attention class at that prefill."""
    import model_zoo

    model = model_zoo.build("diffllama")
    ids = random_ids(1, 10)
    with pytest.raises(RuntimeError, match=r"DiffLlamaAttention .*transformed the cached keys / values"):
        model(ids, **cache_kwargs(QuantizedFP8Cache(model, attention="blockwise")))
    want = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(DynamicCache(config=model.config)))
    for cache in (hf_kvcache.SinkCache(model, sinks=2, window=60), QuantizedFP8Cache(model)):
        layer = cache.layers[0]
        got = model.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(cache))
        assert layer.is_initialized and not layer.attention_from_codes and layer.codes_read is None
        if isinstance(cache, hf_kvcache.SinkCache):  # every token kept: DynamicCache's tokens exactly
            assert torch.equal(got, want)


def test_model_off_the_bridge_is_refused(llama):
    model = tiny_llama()
    cache = QuantizedFP8Cache(model, key_rotation="none", attention="blockwise")
    hf_kvcache.enable(model)
    model.set_attn_implementation("sdpa")  # not the bridge: the stand-ins would be attended to as zeros
    with pytest.raises(RuntimeError, match="not the bridge.*attention='dequantize'"):
        model(random_ids(1, 8), **cache_kwargs(cache))


def test_settings_are_validated(llama):
    with pytest.raises(ValueError, match=r"`attention` must be one of \('auto', 'blockwise', 'dequantize'\)"):
        QuantizedFP8Cache(llama, attention="fast")
    with pytest.raises(ValueError, match="`attention_block` must be an integer >= 1"):
        KIVICache(llama, attention_block=0)
    cache = KIVICache(llama, group_size=8, residual=8, attention="blockwise", attention_block=12)
    with pytest.raises(ValueError, match="`attention_block` must be a multiple of 8"):
        run(llama, cache, random_ids(1, 20), chunks=(16,))
    ids = random_ids(1, 40, seed=12)
    ref = run(llama, KIVICache(llama, group_size=8, residual=8, attention="dequantize"), ids)
    torch.testing.assert_close(
        run(llama, KIVICache(llama, group_size=8, residual=8, attention="blockwise", attention_block=16), ids),
        ref,
        atol=1e-4,
        rtol=0,
    )


def test_auto_resolves_from_the_device(llama, kernel, monkeypatch):
    cache = QuantizedFP8Cache(llama)  # auto
    hf_kvcache.enable(llama)
    reads = []
    monkeypatch.setattr("hf_kvcache.attention.bridge.attend", lambda *a: reads.append(a[1].layer_idx) or attend(*a))
    logits = run(llama, cache, random_ids(1, 20), chunks=(19,))
    layer = cache.layers[0]
    # CPU: the native kernel in decode steps, a dequantized copy for the prefill; without it, always dequantize
    assert layer.attention == "auto" and layer.attention_from_codes == (kernel == "native")
    # per layer, the prefill's check that attention gets its keys and values as they are (then the dequantized
    # copy), and the one decode step; without the kernel, never
    assert reads == ([0, 1, 0, 1] if kernel == "native" else [])
    assert codes_now(layer, 1) == (kernel == "native") and not codes_now(layer, 2)
    assert (cache.workspace_nbytes() > 0) == (kernel == "torch")  # the decode step dequantized the store, or not
    reference = run(llama, QuantizedFP8Cache(llama, attention="dequantize"), random_ids(1, 20), chunks=(19,))
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert resolve_attention(layer, torch.device("cuda")) is True
    layer.attention = "dequantize"
    assert resolve_attention(layer, torch.device("cuda")) is False


def test_segments_survive_a_write_when_stable():
    """`stable=True` (what a prefill chunk uses): the write of new tokens does not change the past's segments."""
    torch.manual_seed(0)
    store = QuantizedStore("fp8_e4m3", "fp8_e4m3", residual=6, append_only=True)
    store.allocate(1, 2, 16, 64, torch.float32, "cpu")
    store.write(None, torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), start=0)
    keys, values = store.segments(20, stable=True)
    before = [dequantize(s).clone() for s in keys + values]
    views, _ = store.segments(20)
    store.write(None, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), start=20)
    assert all(torch.equal(dequantize(s), b) for s, b in zip(keys + values, before))
    assert not torch.equal(dequantize(views[-1]), before[len(keys) - 1])  # the residual views were shifted


def test_region_store_segments_match_its_read():
    """Composite layout: each region's segments in slot order dequantize to what `read` returns."""
    torch.manual_seed(1)
    stores = [
        FullPrecisionStore(),
        QuantizedStore("fp8_e4m3", "int8", append_only=False),
        QuantizedStore("int8", "int8", append_only=False),
    ]
    region = RegionStore([4, 8, None], stores)
    region.allocate(2, 2, 16, 31, torch.float32, "cpu")
    dest = torch.arange(24).view(1, 1, 24).expand(2, 1, 24)
    region.write(dest, torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16))
    for used in (3, 10, 24):
        keys, values = store_segments(region, used)
        read_k, read_v = region.read(used)
        assert [s.format for s in keys] == ["none", "fp8_e4m3", "int8"][: len(keys)]
        torch.testing.assert_close(torch.cat([dequantize(s) for s in keys], 2), read_k, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.cat([dequantize(s) for s in values], 2), read_v, atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="no `segments` method"):
        store_segments(object(), 3)


def test_eviction_caches_decode_through_the_native_kernel_on_cpu(llama, kernel, monkeypatch):
    """A cache without the `attention` option over a full-precision store (SinkCache, SlidingWindowCache)
    reads its keys through the native kernel's full-precision route in eager CPU decode steps
    (`full_precision_native`), with the same logits as SDPA on the same cache (prefill, wrapped ring, sinks
    re-rotated), in float32 and in bfloat16; not where the kernel is off (HF_KVCACHE_NATIVE=0), nor for H2O (its own
    scored pass)."""
    from hf_kvcache import H2OCache, SinkCache, SlidingWindowCache
    from hf_kvcache.layers import codes_read

    ids = random_ids(2, 64, seed=5)
    for make in (lambda m: SinkCache(m, sinks=4, window=20), lambda m: SlidingWindowCache(m, window=24)):
        cache = make(llama)
        native = run(llama, cache, ids)
        assert all(layer.attention_from_codes == (kernel == "native") for layer in cache.layers)
        with monkeypatch.context() as patched:
            patched.setattr(codes_read, "full_precision_native", lambda layer, device: False)
            sdpa_cache = make(llama)
            sdpa = run(llama, sdpa_cache, ids)
        assert not any(layer.attention_from_codes for layer in sdpa_cache.layers)
        torch.testing.assert_close(native, sdpa, atol=2e-5, rtol=1e-5)
    h2o = H2OCache(llama, budget=24)
    run(llama, h2o, ids)
    assert not any(layer.attention_from_codes for layer in h2o.layers)
    # a bfloat16 model: its bfloat16 keys and values are read as they are (widened in registers) and attention runs
    # in float32, where SDPA's CPU kernel runs in bfloat16; measured against the same cache on the float32 model,
    # it is as close as SDPA is (the bfloat16 weights make most of the difference)
    reference = run(llama, SinkCache(llama, sinks=4, window=20), ids)
    bf16 = tiny_llama().to(torch.bfloat16)
    sink = SinkCache(bf16, sinks=4, window=20)
    native16 = run(bf16, sink, ids).float()
    assert all(layer.attention_from_codes == (kernel == "native") for layer in sink.layers)
    with monkeypatch.context() as patched:
        patched.setattr(codes_read, "full_precision_native", lambda layer, device: False)
        sdpa16 = run(bf16, SinkCache(bf16, sinks=4, window=20), ids).float()
    error, sdpa_error = ((x - reference).abs().mean() for x in (native16, sdpa16))
    assert error <= 1.05 * sdpa_error and error < 0.05 * reference.abs().mean()


def test_decode_keeps_the_kernel_view_of_the_store(llama, kernel, monkeypatch):
    """An eager CPU decode step hands the native kernel the layer's kept view of its store (codes_read.KernelView:
    whole buffers flattened once, this step's lengths): the same logits bit for bit as fresh segments every step,
    rebuilt only when a buffer is replaced (growth), dropped by a prefill (it would hold replaced buffers) and
    made for FP8 (bfloat16 scales read as they are), KIVI (codes, scales, zero points, residual) and sinks."""
    from hf_kvcache import SinkCache
    from hf_kvcache.layers import codes_read

    if kernel != "native":
        pytest.skip("the view is the native kernel's")
    ids = random_ids(2, 72, seed=7)
    makes = {"fp8": lambda: QuantizedFP8Cache(llama), "sink": lambda: SinkCache(llama, sinks=4, window=20)}
    if KIVI_BACKENDS:
        makes["kivi"] = lambda: KIVICache(llama, backend=KIVI_BACKENDS[0], residual=8, group_size=16)
    built = []
    real_of = codes_read.KernelView.of

    def counting_of(store, kept):
        view = real_of(store, kept)
        if view is not kept:
            built.append(view)
        return view

    for name, make in makes.items():
        built.clear()
        with monkeypatch.context() as patched:
            patched.setattr(codes_read.KernelView, "of", staticmethod(counting_of))
            cache = make()
            kept = run(llama, cache, ids)
        steps = ids.shape[1] - 40
        assert built and all(v.keys is not None for v in built), name  # the view was made and used
        assert len(built) < steps * len(cache.layers) / 2, (name, len(built))  # and kept across steps
        with monkeypatch.context() as patched:
            patched.setattr(codes_read.KernelView, "of", staticmethod(lambda store, kept: None))
            fresh = run(llama, make(), ids)
        assert torch.equal(kept, fresh), name
        with torch.no_grad():  # a multi-token forward drops the views
            llama(input_ids=ids[:, :3], **cache_kwargs(cache), use_cache=True)
        assert all(layer.kernel_view is None for layer in cache.layers), name
