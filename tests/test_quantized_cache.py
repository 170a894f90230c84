"""QuantizedFP8Cache and KIVICache on tiny models: generate through the registered names, exactness of the plumbing,
error ordering of the formats, beam search, left-padded batches, calibration save/load, non-finite activations."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PAD, build_model, left_pad, random_ids
from transformers import DynamicCache, GenerationConfig

import hf_kvcache
from hf_kvcache import FullCache, KIVICache, QuantizedFP8Cache, cache_kwargs
from hf_kvcache.evaluation.memory import cache_nbytes
from hf_kvcache.sharing.calibration import calibrate, calibrated_scales, save_calibrated_config
from hf_kvcache.stores.quantization import NonFiniteError, backend_available

PACKER = next((b for b in ("quanto", "hqq") if backend_available(b)), None)
needs_packer = pytest.mark.skipif(PACKER is None, reason="neither optimum-quanto nor hqq is installed")
PROMPT, STEPS = 40, 24


def teacher_forced_logprobs(model, cache, ids: torch.Tensor, prompt: int = PROMPT) -> torch.Tensor:
    """Prefill `prompt` tokens, then one token per forward; log-probs [steps + 1, vocab] of row 0."""
    hf_kvcache.enable(model)
    out = []
    with torch.no_grad():
        o = model(input_ids=ids[:, :prompt], **cache_kwargs(cache), use_cache=True)
        out.append(o.logits[:, -1])
        for t in range(prompt, ids.shape[1]):
            o = model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            out.append(o.logits[:, -1])
    return torch.stack(out, 1).log_softmax(-1)


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    return float((ref.exp() * (ref - other)).sum(-1).mean())


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32


@pytest.fixture(scope="module")
def ids():
    return random_ids(1, PROMPT + STEPS, seed=3)


@pytest.fixture(scope="module")
def reference(llama, ids):
    return teacher_forced_logprobs(llama, FullCache(llama), ids)


def test_residual_covering_everything_is_exact(llama, ids, reference):
    """With every token in the full-precision residual nothing is quantized: identical to the full cache (up to
    float rounding of the rotated dot products when keys are rotated)."""
    for cache in (
        QuantizedFP8Cache(llama, residual=1000, key_rotation="none"),
        KIVICache(llama, residual=1000, group_size=8)
        if PACKER
        else QuantizedFP8Cache(llama, residual=500, key_rotation="none"),
    ):
        assert torch.equal(teacher_forced_logprobs(llama, cache, ids), reference)
        assert cache.layers[0].store.qlen == 0
    for rotation in ("hadamard", "random"):
        cache = QuantizedFP8Cache(llama, residual=1000, key_rotation=rotation)
        torch.testing.assert_close(teacher_forced_logprobs(llama, cache, ids), reference, atol=1e-4, rtol=1e-5)


def test_format_precision_orders_the_error(llama, ids, reference):
    """More precise formats give a smaller KL divergence from the full cache; a residual window helps."""
    results = {
        "int8": kl(reference, teacher_forced_logprobs(llama, QuantizedFP8Cache(llama, format="int8"), ids)),
        "e4m3": kl(reference, teacher_forced_logprobs(llama, QuantizedFP8Cache(llama), ids)),
        "e4m3_r16": kl(reference, teacher_forced_logprobs(llama, QuantizedFP8Cache(llama, residual=16), ids)),
        "e5m2": kl(reference, teacher_forced_logprobs(llama, QuantizedFP8Cache(llama, format="fp8_e5m2"), ids)),
    }
    if PACKER:
        results["int2"] = kl(
            reference, teacher_forced_logprobs(llama, KIVICache(llama, bits=2, group_size=8, residual=0), ids)
        )
    assert 0 < results["int8"] < results["e4m3"] < results["e5m2"], results
    assert results["e4m3_r16"] < results["e4m3"], results
    if PACKER:
        assert results["e5m2"] < results["int2"], results
    assert results["e4m3"] < 0.05, results


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize(
    "name, cache_config",
    [
        ("fp8", {}),
        ("fp8", {"granularity": "channel", "group_size": 8, "residual": 4}),
        ("fp8", {"key": {"format": "int8"}, "granularity": "head"}),
        ("kivi", {"group_size": 8, "residual": 8}),
    ],
)
def test_generate_with_registered_names(arch, name, cache_config):
    if name == "kivi" and PACKER is None:
        pytest.skip("neither optimum-quanto nor hqq is installed")
    model = build_model(arch)
    ids = random_ids(2, 30)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation=name, cache_config=cache_config)
    full = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_kwargs(FullCache(model)))
    assert out.shape == (2, 42)
    assert (out[:, 30:] == full[:, 30:]).float().mean() > 0.3  # quantization noise, not garbage


def test_beam_search(llama):
    ids = random_ids(2, 30, seed=5)
    exact = QuantizedFP8Cache(llama, residual=1000)  # beam reordering of the full-precision residual
    kwargs = dict(max_new_tokens=10, num_beams=3, do_sample=False, num_return_sequences=2)
    ref = llama.generate(ids, **cache_kwargs(FullCache(llama)), **kwargs)
    assert torch.equal(llama.generate(ids, **cache_kwargs(exact), **kwargs), ref)
    kivi = [KIVICache(llama, bits=8, group_size=8, residual=4)] if PACKER else []
    for cache in [QuantizedFP8Cache(llama, format="int8")] + kivi:
        out = llama.generate(ids, **cache_kwargs(cache), **kwargs)
        assert out.shape == ref.shape
        assert (out[:, 30:] == ref[:, 30:]).float().mean() > 0.5
        assert cache.layers[0].store.batch == 6  # 2 prompts x 3 beams


def test_left_padded_batch_equals_rows_alone(llama):
    """Per-token scales depend only on the token itself: a padded batch generates what each row generates alone."""
    rows = [random_ids(1, n, seed=n)[0] for n in (10, 17, 13)]
    ids, mask = left_pad(rows)
    kwargs = dict(
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=PAD,
        cache_implementation="fp8",
        cache_config={"key_smoothing": False},
    )
    batched = llama.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    for i, row in enumerate(rows):
        alone = llama.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), i


@needs_packer
def test_left_padded_batch_kivi(llama):
    rows = [random_ids(1, n, seed=n)[0] for n in (10, 17, 13)]
    ids, mask = left_pad(rows)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    full = llama.generate(ids, attention_mask=mask, **cache_kwargs(FullCache(llama)), **kwargs)
    exact = llama.generate(
        ids, attention_mask=mask, cache_implementation="kivi", cache_config={"group_size": 8, "residual": 100}, **kwargs
    )
    assert torch.equal(exact, full)
    out = llama.generate(
        ids,
        attention_mask=mask,
        cache_implementation="kivi",
        cache_config={"bits": 8, "group_size": 8, "residual": 0},
        **kwargs,
    )
    assert (out[:, ids.shape[1] :] == full[:, ids.shape[1] :]).float().mean() > 0.6


def test_non_finite_activation_is_a_clear_error(llama):
    model = build_model("llama")
    handle = model.model.layers[1].self_attn.v_proj.register_forward_hook(
        lambda module, args, out: out.index_fill(-1, torch.tensor([3]), float("nan"))
    )
    try:
        with pytest.raises(NonFiniteError, match=r"QuantizedFP8Cache \(layer 1\): \d+ non-finite values"):
            model.generate(random_ids(1, 10), max_new_tokens=3, cache_implementation="fp8")
    finally:
        handle.remove()


def test_memory_is_the_quantized_cache_plus_one_layer(llama):
    ids = random_ids(1, 200)
    cache = QuantizedFP8Cache(llama, key_smoothing=False)
    dynamic = DynamicCache(config=llama.config)
    llama.generate(ids, max_new_tokens=1, **cache_kwargs(cache))
    llama.generate(ids, max_new_tokens=1, do_sample=False, **cache_kwargs(dynamic))
    full_bytes = cache_nbytes(dynamic)  # float32: 4 bytes per value
    store_bytes = sum(layer.store.nbytes() for layer in cache.layers)
    assert store_bytes <= full_bytes * (1 + 2 / 32) / 4 * 1.01  # 1 byte per value + a bfloat16 scale per 32
    layers = llama.config.num_hidden_layers
    one_layer = full_bytes / layers
    assert cache.workspace_nbytes() <= 2 * one_layer * 1.5  # keys+values of one layer (x2 doubling) + scratch


# -- calibration ---------------------------------------------------------------------------------------------------
def test_calibration_records_the_maxima(llama):
    ids = random_ids(2, 48, seed=9)
    scales = calibrate(llama, input_ids=ids, window=16, key_smoothing=False, key_rotation="none")
    json.dumps(scales)  # plain JSON
    dyn_k, dyn_v = [], []
    for start in range(0, 48, 16):
        cache = DynamicCache(config=llama.config)
        with torch.no_grad():
            llama(input_ids=ids[:, start : start + 16], **cache_kwargs(cache))
        dyn_k.append([layer.keys for layer in cache.layers])
        dyn_v.append([layer.values for layer in cache.layers])
    for i in range(llama.config.num_hidden_layers):
        keys = torch.cat([w[i] for w in dyn_k], 2)
        values = torch.cat([w[i] for w in dyn_v], 2)
        expected_k = keys.abs().amax(dim=(0, 2, 3)) / 448
        expected_v = values.abs().amax(dim=(0, 2, 3)) / 448
        torch.testing.assert_close(torch.tensor(scales["key_scale"][i]), expected_k)
        torch.testing.assert_close(torch.tensor(scales["value_scale"][i]), expected_v)
        torch.testing.assert_close(torch.tensor(scales["key_mean"][i]), keys.mean(dim=(0, 2)), atol=1e-5, rtol=1e-5)
    smoothed = calibrate(llama, input_ids=ids, window=16, key_smoothing=True, key_rotation="none")
    assert smoothed["key_smoothing"] and not scales["key_smoothing"]
    keys = torch.cat([w[0] for w in dyn_k], 2)
    centred = keys - keys.mean(dim=(0, 2), keepdim=True)
    torch.testing.assert_close(torch.tensor(smoothed["key_scale"][0]), centred.abs().amax(dim=(0, 2, 3)) / 448)
    assert smoothed["value_scale"] == scales["value_scale"]


def test_calibrated_cache_uses_static_scales_and_saturates(llama, ids, reference):
    scales = calibrate(llama, input_ids=random_ids(1, 64, seed=11), window=32, key_smoothing=True)
    cache = QuantizedFP8Cache(llama, granularity="head", key_smoothing=True, scales=scales)
    got = teacher_forced_logprobs(llama, cache, ids)
    store = cache.layers[1].store
    assert torch.equal(store.keys_codec.scale.flatten(), torch.tensor(scales["key_scale"][1]))
    assert torch.equal(store.values_codec.scale.flatten(), torch.tensor(scales["value_scale"][1]))
    assert torch.equal(store.key_mean[0, :, 0], torch.tensor(scales["key_mean"][1]))
    assert kl(reference, got) < 0.2
    # vLLM's "scale 1.0": values beyond 448 saturate, nothing is NaN
    ones = QuantizedFP8Cache(llama, granularity="tensor", key_smoothing=False, scales=calibrated_scales(llama, 1.0))
    assert torch.isfinite(teacher_forced_logprobs(llama, ones, ids)).all()


def test_calibration_save_and_load(tmp_path, llama):
    scales = calibrate(llama, input_ids=random_ids(1, 32, seed=2), window=32)
    path = save_calibrated_config(tmp_path, llama, scales)
    loaded = hf_kvcache.load_cache_config(tmp_path)
    assert loaded["cache_implementation"] == "fp8" and loaded["cache_config"]["scales"] == scales
    ids = random_ids(1, 20)
    a = llama.generate(ids, max_new_tokens=8, do_sample=False, **loaded)
    b = llama.generate(
        ids,
        max_new_tokens=8,
        do_sample=False,
        **cache_kwargs(QuantizedFP8Cache(llama, granularity="head", scales=scales)),
    )
    assert torch.equal(a, b)
    # published in generation_config.json instead
    llama.generation_config.cache_implementation = "fp8"
    llama.generation_config.cache_config = {"granularity": "head", "scales": scales}
    try:
        llama.generation_config.save_pretrained(tmp_path / "model")
        generation = GenerationConfig.from_pretrained(tmp_path / "model")
    finally:
        llama.generation_config.cache_implementation = None
        llama.generation_config.cache_config = None
    assert generation.cache_config["scales"] == scales
    c = llama.generate(ids, max_new_tokens=8, do_sample=False, generation_config=generation)
    assert torch.equal(c, a)
    assert path.endswith("kvcache_config.json")


def test_bad_calibration_dicts(llama):
    scales = calibrate(llama, input_ids=random_ids(1, 16), window=16)
    with pytest.raises(ValueError, match=r"calibrated for num_layers=3, this model has 2"):
        QuantizedFP8Cache(llama, granularity="head", scales={**scales, "num_layers": 3})
    with pytest.raises(ValueError, match=r"calibrated for format 'fp8_e4m3', but keys use 'fp8_e5m2'"):
        QuantizedFP8Cache(llama, format="fp8_e5m2", granularity="head", scales=scales)
    with pytest.raises(ValueError, match=r"calibrated with key_smoothing=False, but the cache has key_smoothing=True"):
        QuantizedFP8Cache(llama, granularity="head", key_smoothing=True, scales=scales)
    with pytest.raises(ValueError, match=r"scales\['key_scale'\]\[0\] must be a list of 2 numbers"):
        QuantizedFP8Cache(llama, granularity="head", scales={**scales, "key_scale": [[1.0], [1.0]]})
    with pytest.raises(ValueError, match=r"Unknown `scales` .* key\(s\) \['extra'\]"):
        QuantizedFP8Cache(llama, granularity="head", scales={**scales, "extra": 1})
    with pytest.raises(ValueError, match=r"FP8 scales must be finite and positive"):
        QuantizedFP8Cache(
            llama,
            granularity="head",
            key_smoothing=False,
            scales={**calibrated_scales(llama, 1.0), "value_scale": [[0.0, 1.0]] * 2},
        )
    with pytest.raises(ValueError, match=r"Give `input_ids` or a `tokenizer`"):
        calibrate(llama)


def test_composite_cache_region_in_fp8():
    """CompositeCache regions use these stores (slot layout): sinks in full precision, older tokens FP8/INT."""
    model = build_model("llama")
    regions = [
        {"role": "sinks", "tokens": 2},
        {"role": "window", "start": 0, "end": 8},
        {"role": "rest", "keys": "fp8_e4m3", "values": "int4" if PACKER else "int8"},
    ]
    ids = random_ids(1, 30)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=False, cache_implementation="composite", cache_config={"regions": regions}
    )
    full = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(FullCache(model)))
    assert out.shape == full.shape
    assert (out[:, 30:] == full[:, 30:]).float().mean() > 0.3


def test_crop_for_assisted_decoding(llama):
    """Dropping the last tokens (assisted decoding): exact inside the full-precision residual and for per-token
    scales; inside a KIVI key block it is a clear error."""
    ids = random_ids(1, 44, seed=4)
    hf_kvcache.enable(llama)
    with torch.no_grad():
        for cache in (QuantizedFP8Cache(llama, residual=8), QuantizedFP8Cache(llama)):
            llama(input_ids=ids[:, :40], **cache_kwargs(cache))
            cache.crop(-3)
            assert cache.get_seq_length() == 37
            out = llama(input_ids=ids[:, 37:38], **cache_kwargs(cache)).logits[0, -1].log_softmax(-1)
            full = FullCache(llama)
            ref = llama(input_ids=ids[:, :38], **cache_kwargs(full)).logits[0, -1].log_softmax(-1)
            assert cache.layers[0].store.length == 38
            assert kl(ref[None], out[None]) < 0.05
        if PACKER:
            kivi = KIVICache(llama, group_size=8, residual=2)
            llama(input_ids=ids[:, :40], **cache_kwargs(kivi))  # 32 tokens quantized in blocks of 8
            kivi.crop(-4)  # to 36: inside the full-precision part (tokens 32..39): fine
            llama(input_ids=ids[:, 36:37], **cache_kwargs(kivi))
            with pytest.raises(NotImplementedError, match=r"cannot crop to 28 tokens.*Keep `residual` at least"):
                kivi.crop(-9)  # to 28: inside the quantized block [24, 32): refused by the crop itself
            assert kivi.get_seq_length() == 37  # unchanged, and still usable
            llama(input_ids=ids[:, 37:38], **cache_kwargs(kivi))
            assert kivi.get_seq_length() == 38


@needs_packer
def test_4k_tokens_whole_cache_bytes_versus_dynamic_cache_in_bfloat16():
    """The issue's memory bound on everything `nbytes()` counts (stores, slot metadata, rotation matrix): at 4K
    tokens FP8 (per-token scales) <= 0.52x and INT4 group 64 <= 0.30x of a bfloat16 DynamicCache."""
    model = build_model(
        "llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=8192
    ).to(torch.bfloat16)  # head_dim 64, as SmolLM2
    ids = random_ids(1, 4096, seed=8)
    dynamic = DynamicCache(config=model.config)
    caches = {"fp8": QuantizedFP8Cache(model), "int4": KIVICache(model, bits=4, group_size=64, residual=0)}
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(dynamic), use_cache=True, logits_to_keep=1)
        for cache in caches.values():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    ratios = {name: cache.nbytes() / dyn_bytes for name, cache in caches.items()}
    assert ratios["fp8"] <= 0.52, ratios
    assert ratios["int4"] <= 0.30, ratios
    assert ratios["fp8"] >= 0.5 and ratios["int4"] >= 0.25, ratios  # nothing left uncounted


@needs_packer
def test_whole_cache_nbytes_is_the_theoretical_size_while_decoding():
    """`cache.nbytes()` (everything held: stores, slot metadata, rotation matrix) within 1% of values x bits / 8 +
    scales (+ zero points) + the residual buffer (+ the one rotation matrix), after a prefill and through 100
    decode steps. SmolLM2's attention shape: 3 KV heads of 64."""
    model = build_model(
        "llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=2048
    )
    layers, heads, d = model.config.num_hidden_layers, 3, 64
    ids = random_ids(1, 1101, seed=12)
    fp8, kivi = QuantizedFP8Cache(model), KIVICache(model, bits=4, group_size=32, residual=128)
    with torch.no_grad():
        for cache in (fp8, kivi):
            model(input_ids=ids[:, :1000], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        for t in range(1000, 1100):
            for cache in (fp8, kivi):
                model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            n = t + 1
            # E4M3 bytes + one bfloat16 scale per token and head, + the [d, d] float32 rotation matrix
            fp8_theory = layers * heads * n * 2 * (d + 2) + d * d * 4
            store = kivi.layers[0].store
            q, fp_slots = store.qlen, store.fp_k.shape[2]
            # keys: 4 bits + a scale and zero (float32) per channel and 32 tokens; values: 4 bits + a scale and zero
            # per 32 channels; the full-precision residual buffer
            per_head = q * (d // 2 + d * 8 // 32) + q * (d // 2 + (d // 32) * 8) + 2 * fp_slots * d * 4
            kivi_theory = layers * heads * per_head
            assert abs(fp8.nbytes() - fp8_theory) <= 0.01 * fp8_theory, (n, fp8.nbytes(), fp8_theory)
            assert abs(kivi.nbytes() - kivi_theory) <= 0.01 * kivi_theory, (n, kivi.nbytes(), kivi_theory)
