"""Hybrid models (sliding + full attention layers; linear-attention / convolution + full attention layers), per-layer
settings, and latent attention (MLA) head sizes.

Full-attention layers get the cache's policy x store; sliding layers keep exactly the model's window, and
linear-attention / convolution layers their states, through transformers' own layer classes; `layers` gives
per-layer-type or per-index settings."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import build_model, left_pad, random_ids
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

import hf_kvcache
from hf_kvcache import FullCache, H2OCache, QuantizedFP8Cache, SinkCache, SlidingWindowCache, cache_kwargs
from hf_kvcache.layers.layer import CompressedLayer

HYBRID = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def hybrid_configs():
    return [
        transformers.Gemma2Config(num_hidden_layers=2),
        transformers.Qwen2Config(
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=1),
        transformers.MistralConfig(num_hidden_layers=2, sliding_window=4096),
    ]


@pytest.mark.parametrize("index", range(4))
def test_layers_follow_the_model_layer_types(index):
    """Full-attention layers are ours; a sliding layer is transformers' own: StaticCache's, sized to its window, under a
    cache whose compressed layers keep fixed shapes (so the whole cache compiles), else DynamicCache's."""
    config = hybrid_configs()[index]
    types = transformers.cache_utils.get_layer_types_and_kwargs(config)[0]
    for cache in (SinkCache(config, sinks=4, window=8), SlidingWindowCache(config, window=8), FullCache(config)):
        assert len(cache.layers) == len(types)
        fixed = not isinstance(cache, FullCache) and "full_attention" in types  # (Mistral's: every layer slides)
        assert cache.is_compileable == fixed
        for layer, layer_type in zip(cache.layers, types):
            if layer_type == "full_attention":
                assert isinstance(layer, CompressedLayer)
            elif fixed:
                assert isinstance(layer, StaticSlidingWindowLayer) and layer.is_compileable
                assert layer.max_cache_len == config.sliding_window
            else:
                assert isinstance(layer, DynamicSlidingWindowLayer)
                assert layer.sliding_window == config.sliding_window


def _generate(model, cache, ids, mask, new=8):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **cache_kwargs(cache)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda m: SinkCache(m, sinks=2, window=60),
        lambda m: SlidingWindowCache(m, window=64),
        lambda m: H2OCache(m, heavy=32, recent=32),
        lambda m: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=64, precision="full"),
    ],
)
def test_hybrid_generation_equals_dynamic_cache_at_full_budget(make):
    model = build_model("qwen2", **HYBRID)
    ids, mask = left_pad([random_ids(1, 14, seed=1)[0], random_ids(1, 10, seed=2)[0]])
    reference = _generate(model, DynamicCache(config=model.config), ids, mask)
    assert torch.equal(_generate(model, make(model), ids, mask), reference)


def test_hybrid_small_budget_bytes_are_window_plus_budget():
    model = build_model(
        "qwen2",
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    ids = random_ids(2, 20)
    sizes = []
    for new in (4, 12):
        cache = SinkCache(model, sinks=2, window=6)
        _generate(model, cache, ids, torch.ones_like(ids), new)
        sliding = [layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer)]
        assert len(sliding) == 2 and all(layer.keys.shape[-2] <= model.config.sliding_window for layer in sliding)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1]  # flat: neither the sliding layers nor ours grow with the stream


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2"])
def test_linear_attention_hybrids_count_their_tokens_and_states(arch):
    """Qwen3-Next (gated DeltaNet layers) and LFM2 (convolution layers) put a layer without keys first: the cache's
    length is its first attention layer's (as transformers' Cache says; generate asks for it before the first
    forward), and `nbytes` counts the linear layers' conv / recurrent states, which DynamicCache holds alike."""
    import model_zoo
    from transformers.cache_utils import LinearAttentionLayer

    model = model_zoo.build(arch)
    ids = random_ids(2, 12, seed=3)
    reference = DynamicCache(config=model.config)
    for cache in (SinkCache(model, sinks=2, window=60), QuantizedFP8Cache(model)):
        assert isinstance(cache.layers[0], LinearAttentionLayer) and cache.get_seq_length() == 0
        with torch.no_grad():
            model(ids, **cache_kwargs(cache), use_cache=True)
        assert cache.get_seq_length() == 12
        states = sum(
            t.nbytes
            for t in (*cache.layers[0].conv_states.values(), *cache.layers[0].recurrent_states.values())
            if t is not None
        )
        assert states > 0
        rotation = getattr(cache, "rotation_matrix", None)  # (FP8's key rotation, counted once)
        assert cache.nbytes() == states + sum(layer.nbytes() for layer in cache.compressed_layers) + (
            0 if rotation is None else rotation.nbytes
        )
    with torch.no_grad():
        model(ids, **cache_kwargs(reference), use_cache=True)
    assert states == sum(
        t.nbytes
        for t in (*reference.layers[0].conv_states.values(), *reference.layers[0].recurrent_states.values())
        if t is not None
    )


def test_gemma4_heterogeneous_layers_and_kv_sharing(tmp_path):
    """Gemma 4: its full layers have their own head_dim (32 here, 16 on sliding layers; the global attribute raises),
    and its last layers attend to what earlier layers cached (KV sharing). A quantized cache sizes its key rotation
    by the full layers; a sharing producer hands out real keys and values (never stand-ins) and its consumer attends
    with the producer's validity (greedy tokens equal DynamicCache's at a budget keeping every token); 'blockwise' is
    refused by name; the cache's state file round-trips."""
    import model_zoo

    from hf_kvcache.sharing.state import load_cache_state, save_cache_state

    model = model_zoo.build("gemma4")
    ids, mask = left_pad([random_ids(1, 14, seed=1)[0], random_ids(1, 10, seed=2)[0]])
    want = _generate(model, DynamicCache(config=model.config), ids, mask)
    fp8 = QuantizedFP8Cache(model)
    assert fp8.rotation_matrix.shape == (32, 32)
    assert [type(layer).__name__ for layer in fp8.layers] == [
        "DynamicSlidingWindowLayer",
        "CompressedLayer",
        "DummyLayer",
        "DummyLayer",
    ]
    for cache in (SinkCache(model, sinks=2, window=60), H2OCache(model, heavy=32, recent=32), fp8):
        got = _generate(model, cache, ids, mask)
        producer = cache.layers[1]
        assert producer.kv_shared and not producer.attention_from_codes
        if not isinstance(cache, QuantizedFP8Cache):
            assert torch.equal(got, want)
    path = tmp_path / "gemma4.safetensors"
    save_cache_state(fp8, path)
    loaded = load_cache_state(path, model)
    step = got[:, -1:]
    with torch.no_grad():
        a = model(step, **cache_kwargs(fp8)).logits
        b = model(step, **cache_kwargs(loaded)).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"attention='blockwise' .*KV sharing"):
        model(ids, **cache_kwargs(QuantizedFP8Cache(model, attention="blockwise")))


def test_keys_repeated_after_the_cache():
    """JetMoE repeats its cached key / value heads after the cache's update: caches that read the cache as it is work
    (greedy tokens equal DynamicCache's at a budget keeping every token; the first prefill shows the repeat, so FP8
    reads that layer dequantized), and a cache that scores attention per cached head is refused by name."""
    config = transformers.JetMoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        kv_channels=16,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(config).eval()
    ids = random_ids(1, 12, seed=5)
    want = _generate(model, DynamicCache(config=model.config), ids, torch.ones_like(ids), 5)
    for cache in (SinkCache(model, sinks=2, window=60), QuantizedFP8Cache(model)):
        got = _generate(model, cache, ids, torch.ones_like(ids), 5)
        assert not cache.layers[0].attention_from_codes
        if isinstance(cache, SinkCache):
            assert torch.equal(got, want)
    with pytest.raises(
        ValueError,
        match=r"JetMoeAttention \(layer 0\) attends with 4 key heads made from the 2 it "
        r"caches .*HeavyHitterPolicy",
    ):
        _generate(model, H2OCache(model, heavy=32, recent=32), ids, torch.ones_like(ids), 2)


def test_a_model_without_attention_layers_is_refused_by_name():
    """Only convolution / recurrent layers (an LFM2 config of conv layers only): no keys and values to cache, so a
    clear refusal when the cache is built (before, generate failed inside transformers' get_seq_length)."""
    config = transformers.Lfm2Config(
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "conv"],
        block_dim=64,
        block_ff_dim=128,
        conv_L_cache=3,
    )
    for make in (lambda: SinkCache(config, sinks=2, window=8), lambda: QuantizedFP8Cache(config)):
        with pytest.raises(
            ValueError,
            match=r"Lfm2Config has no attention layer \(layer types \['conv'\]\).*"
            r"no KV cache to compress",
        ):
            make()


def test_full_layers_of_different_shapes_are_refused_by_name():
    """A heterogeneous config whose full-attention layers disagree in head_dim: one shape is what a quantized cache
    sizes its key rotation and scales by, so it is refused naming the shapes (not the AmbiguousGlobalPerLayer error
    of the global attribute)."""
    config = transformers.Gemma4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        per_layer_config={1: {"head_dim": 32}, 3: {"head_dim": 64}},
    )
    with pytest.raises(
        ValueError,
        match=r"full-attention layers differ in \(heads, KV heads, head_dim\) "
        r"\[\(4, 2, 32\), \(4, 2, 64\)\]",
    ):
        QuantizedFP8Cache(config)


def test_per_layer_settings_by_type_and_index():
    model = build_model("llama", num_hidden_layers=4)
    cache = SinkCache(model, sinks=2, budget=8, layers={"2": "keep", 3: {"budget": 16}})
    policies = [layer.policy for layer in cache.layers]
    assert [getattr(p, "capacity", None) for p in policies] == [8, 8, None, 16]
    pyramid = H2OCache(model, budget=8, layers=[{"budget": 32}, {"budget": 16}, None, {"heavy": 1, "recent": 3}])
    assert [layer.policy.capacity for layer in pyramid.layers] == [32, 16, 8, 4]
    other = SinkCache(model, sinks=2, window=6, layers={"full_attention": {"cache": "fp8"}})
    assert all(type(layer.store).__name__ == "QuantizedStore" for layer in other.layers)
    ids = random_ids(1, 12)
    out = _generate(model, other, ids, torch.ones_like(ids), 4)
    assert out.shape == (1, 16)


def test_per_layer_settings_through_generate():
    model = build_model("qwen2", **HYBRID)
    ids = random_ids(1, 12)
    cfg = {"window": 6, "layers": {"full_attention": {"window": 4}, "sliding_attention": "keep"}}
    out = model.generate(
        input_ids=ids, max_new_tokens=5, do_sample=False, cache_implementation="sliding", cache_config=cfg
    )
    assert out.shape == (1, 17)


@pytest.mark.parametrize(
    "layers, match",
    [
        ({"sliding_attention": {"window": 2}}, "keeps exactly the model's own window"),
        ({"mamba": "keep"}, "not a layer type of this model"),
        ({"7": "keep"}, "layer index must be in 0..1"),
        (["keep"], "one entry per decoder layer"),
        ({"full_attention": "squash"}, "must be one of"),
        ({"full_attention": {"windw": 3}}, "windw"),
        ({"full_attention": {"cache": "nope"}}, "`cache` must be one of"),
        ("keep", "must be a dict"),
    ],
)
def test_bad_per_layer_settings_name_the_field(layers, match):
    config = build_model("qwen2", **HYBRID).config
    with pytest.raises(ValueError, match=match):
        SlidingWindowCache(config, window=8, layers=layers)


def deepseek_v3(**overrides):
    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=None,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    "make",
    [
        lambda m: SlidingWindowCache(m, window=64),
        lambda m: H2OCache(m, heavy=32, recent=32),
        lambda m: SinkCache(m, sinks=2, window=60, position_mode="original"),
    ],
)
def test_latent_attention_equals_dynamic_cache_at_full_budget(make):
    model = deepseek_v3()
    ids, mask = left_pad([random_ids(1, 14, seed=1)[0], random_ids(1, 10, seed=2)[0]])
    reference = _generate(model, DynamicCache(config=model.config), ids, mask)
    cache = make(model)
    assert torch.equal(_generate(model, cache, ids, mask), reference)
    layer = cache.layers[0]
    assert layer.store.keys.shape[-1] == 24 and layer.store.values.shape[-1] == 8  # latent, RoPE part


def test_latent_attention_quantized_and_refusals():
    model = deepseek_v3()
    cache = QuantizedFP8Cache(model)  # key_rotation "auto": none, the latent is not an attention key
    assert cache.rotation_matrix is None
    ids = random_ids(2, 12)
    logits_ref = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
    logits = model(ids, **cache_kwargs(cache)).logits
    assert torch.allclose(logits, logits_ref, atol=0.1)
    with pytest.raises(ValueError, match="key_rotation.*latent"):
        QuantizedFP8Cache(model, key_rotation="hadamard")
    with pytest.raises(ValueError, match="position_mode.*latent"):
        SinkCache(model, sinks=2, window=6)


def test_static_sliding_layers_crop_only_within_their_window():
    """Under a fixed-capacity cache a hybrid model's sliding layers are StaticCache's, which cannot bring back tokens
    they dropped: the cache is croppable (assisted decoding) while every sliding layer holds all it has seen, and
    past the window it says so; a crop then raises naming the layer before touching any, where transformers' layer
    would have cropped silently wrong. Assisted generation within the window gives the cache's own tokens; past it,
    transformers refuses it up front."""
    import model_zoo

    model, draft = model_zoo.build("gemma3"), model_zoo.build("gemma3", seed=1)  # sliding window 8
    make = lambda: SinkCache(model, sinks=2, window=40)
    ids = random_ids(1, 4, seed=3)
    alone = _generate(model, make(), ids, torch.ones_like(ids), 3)
    assisted = model.generate(
        input_ids=ids, max_new_tokens=3, do_sample=False, assistant_model=draft, **cache_kwargs(make())
    )
    assert torch.equal(assisted, alone)
    long = random_ids(1, 12, seed=4)
    with pytest.raises(ValueError, match="can be cropped"):
        model.generate(input_ids=long, max_new_tokens=3, do_sample=False, assistant_model=draft, **cache_kwargs(make()))
    cache = make()
    with torch.no_grad():
        model(long[:, :6], **cache_kwargs(cache))
        assert cache.is_croppable
        cache.crop(-2)
        model(long[:, 4:], **cache_kwargs(cache))  # 12 tokens seen: past the window of 8
    assert not cache.is_croppable and cache.get_seq_length() == 12
    with pytest.raises(ValueError, match=r"Cannot crop layer 0 \(StaticSlidingWindowLayer, window 8\): it has seen 12"):
        cache.crop(-2)
    assert cache.get_seq_length() == 12 and cache.layers[1].seen == 12  # nothing was cropped


def test_modules_that_update_another_slot_than_their_layer_idx():
    """HRM runs one stack of attention modules in several recurrent cycles, each cycle's keys and values in its own
    cache slot (`layer_idx + cycle_offset`), so a module's `layer_idx` is not the layer it just updated: the bridge
    attends as the layer updated last (`attended_layer`). Greedy tokens equal DynamicCache's, left padding included
    (before: the bridge attended as slot `layer_idx`, and the caches that read from codes raised)."""
    config = transformers.AutoConfig.for_model(
        "hrm_text",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=256,
        H_cycles=2,
        L_cycles=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    assert model.config.num_hidden_layers > len({m.layer_idx for m in model.modules() if hasattr(m, "q_proj")})
    ids, mask = left_pad([random_ids(1, 14, seed=1)[0], random_ids(1, 10, seed=2)[0]])
    want = _generate(model, DynamicCache(config=model.config), ids, mask)
    for cache in (SinkCache(model, sinks=2, window=60), H2OCache(model, heavy=32, recent=32), QuantizedFP8Cache(model)):
        assert torch.equal(_generate(model, cache, ids, mask), want), type(cache).__name__
