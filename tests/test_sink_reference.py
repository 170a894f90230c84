"""SinkCache against a direct, slow reference implementation of StreamingLLM written here from scratch.

The reference keeps keys UN-rotated (RoPE undone with each token's absolute position as it arrives), keeps the first
S and last W tokens with plain torch.cat, and on each update re-rotates every kept key. In "cache" mode the L kept
keys go to positions (p_query - L + 1 + slot), slot = 0..L-1: by RoPE relativity this is StreamingLLM's in-cache
positions 0..L-1 with the query at L-1. In "original" mode each key keeps the position it arrived at.

The reference knows the RoPE conventions it is given (written here from the modeling files, independently of
hf_kvcache.common.rope): rotate-half or interleaved pairs (GLM-4), and layers without RoPE (SmolLM3's NoPE layers,
Cohere2's
full-attention layers), whose keys it keeps as they arrived. The rotator's own tests follow at the end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, random_ids
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from hf_kvcache import SinkCache, SlidingWindowCache, cache_kwargs


def rope_rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    inv_freq: torch.Tensor | None = None,
    interleaved: bool = False,
):
    """Rotate-half RoPE of x [B, H, n, D] to positions [n] (float64 for a clean reference). By default the standard
    frequencies theta^(-2i/D) over the whole head; `inv_freq` overrides them (scaled RoPE types, partial rotary:
    only the first 2 * len(inv_freq) dims rotate). `interleaved`: pair i is dims (2i, 2i + 1) instead of
    (i, i + rot/2) (GLM, Cohere: rotate_half on x[..., 0::2], x[..., 1::2])."""
    dim = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    inv_freq = inv_freq.to(torch.float64)
    rot = 2 * inv_freq.numel()
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]  # [n, rot/2]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    xd = x.to(torch.float64)
    xr, rest = xd[..., :rot], xd[..., rot:]
    if interleaved:
        cos, sin = freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)
        rotated_half = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    else:
        half = rot // 2
        rotated_half = torch.cat((-xr[..., half:], xr[..., :half]), -1)
    return torch.cat((xr * cos + rotated_half * sin, rest), -1)


class ReferenceSinkLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, sinks: int, window: int, theta: float, mode: str, inv_freq=None, interleaved=False, rope=True):
        super().__init__()
        self.sinks, self.window, self.theta, self.mode, self.inv_freq = sinks, window, theta, mode, inv_freq
        self.interleaved, self.rope = interleaved, rope  # rope=False: a NoPE layer, keys carry no position
        self.seen = 0
        self.pos: list[int] = []
        self.k_plain: torch.Tensor | None = None  # un-rotated keys, float64
        self.k_orig: torch.Tensor | None = None  # keys as they arrived
        self.v: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states):
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        new_pos = torch.arange(self.seen, self.seen + q)
        plain = self._rotate(key_states, -new_pos)
        if self.k_plain is None:
            self.k_plain, self.k_orig, self.v = plain, key_states, value_states
        else:
            self.k_plain = torch.cat((self.k_plain, plain), -2)
            self.k_orig = torch.cat((self.k_orig, key_states), -2)
            self.v = torch.cat((self.v, value_states), -2)
        self.pos += new_pos.tolist()
        self.seen += q

        if q == 1:
            # decode: the new token takes the place of the evicted one, attention sees the S + W kept tokens
            self._evict()
        keys = self.k_orig if self.mode == "original" else self._rotated_cache_positions(q)
        values = self.v
        # a multi-token forward attends to the kept past plus its whole chunk, then keeps the survivors
        self._evict()
        return keys, values

    def _rotated_cache_positions(self, q: int) -> torch.Tensor:
        """The L_past kept past tokens sit contiguously just before the first new token (position P); the q new
        tokens keep their own positions P..P+q-1 (for q = 1: positions p_query - L + 1 + slot)."""
        past = len(self.pos) - q
        first_new = self.seen - q
        target = torch.cat((torch.arange(past) + (first_new - past), torch.arange(first_new, self.seen)))
        return self._rotate(self.k_plain, target).to(self.dtype)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.rope:
            return x.to(torch.float64)
        return rope_rotate(x, positions, self.theta, self.inv_freq, self.interleaved)

    def _evict(self):
        n = len(self.pos)
        if n <= self.sinks + self.window:
            return
        keep = list(range(self.sinks)) + list(range(n - self.window, n))
        idx = torch.tensor(keep)
        self.k_plain = self.k_plain.index_select(-2, idx)
        self.k_orig = self.k_orig.index_select(-2, idx)
        self.v = self.v.index_select(-2, idx)
        self.pos = [self.pos[i] for i in keep]

    def get_mask_sizes(self, query_length: int):
        if query_length == 1:
            kv_length = min(self.seen + 1, self.sinks + self.window)
        else:
            kv_length = len(self.pos) + query_length
        return kv_length, self.seen + query_length - kv_length

    def get_seq_length(self):
        return self.seen

    def get_max_length(self):
        return -1


class ReferenceSinkCache(Cache):
    """`rope_layers[i]` False: layer i has no RoPE. Sliding layers (config.layer_types) keep the model's own window
    through transformers' sliding layer, as our caches do."""

    def __init__(
        self, config, sinks: int, window: int, mode: str = "cache", inv_freq=None, interleaved=False, rope_layers=None
    ):
        theta = config.rope_parameters["rope_theta"]
        n = config.num_hidden_layers
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        rope_layers = [True] * n if rope_layers is None else rope_layers
        layers = [
            DynamicSlidingWindowLayer(sliding_window=config.sliding_window)
            if types[i] == "sliding_attention"
            else ReferenceSinkLayer(sinks, window, theta, mode, inv_freq, interleaved, rope_layers[i])
            for i in range(n)
        ]
        super().__init__(layers=layers)


def stream_logits(model, cache, ids: torch.Tensor, prefill: int = 1, chunk: int = 1) -> torch.Tensor:
    """Prefill `prefill` tokens, then `chunk` tokens per forward; logits of every position [T, V]."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :prefill], **cache_kwargs(cache), use_cache=True).logits[0])
        for t in range(prefill, ids.shape[1], chunk):
            out.append(model(ids[:, t : t + chunk], **cache_kwargs(cache), use_cache=True).logits[0])
    return torch.cat(out, 0)


SINKS, WINDOW, LENGTH = 2, 6, 60


def test_reference_self_check_undo_rope():
    """The reference's un-rotation is the exact inverse of its rotation, and matches transformers' RoPE."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model = build_model("llama")
    cfg = model.config
    rotary = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, 2, 5, cfg.hidden_size // cfg.num_attention_heads)
    pos = torch.arange(10, 15)
    cos, sin = rotary(x, pos[None])
    _, hf_rot = apply_rotary_pos_emb(x, x, cos, sin)
    ours = rope_rotate(x, pos, cfg.rope_parameters["rope_theta"])
    torch.testing.assert_close(ours.float(), hf_rot, atol=1e-5, rtol=1e-5)
    back = rope_rotate(ours, -pos, cfg.rope_parameters["rope_theta"])
    torch.testing.assert_close(back.float(), x, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cache_mode_matches_reference_one_token_per_forward(arch):
    model = build_model(arch)
    ids = random_ids(1, LENGTH, seed=1)
    ref = stream_logits(model, ReferenceSinkCache(model.config, SINKS, WINDOW, "cache"), ids)
    got = stream_logits(model, SinkCache(model, sinks=SINKS, window=WINDOW, position_mode="cache"), ids)
    assert got.shape == ref.shape == (LENGTH, model.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_original_mode_matches_reference_one_token_per_forward(arch):
    model = build_model(arch)
    ids = random_ids(1, LENGTH, seed=2)
    ref = stream_logits(model, ReferenceSinkCache(model.config, SINKS, WINDOW, "original"), ids)
    got = stream_logits(model, SinkCache(model, sinks=SINKS, window=WINDOW, position_mode="original"), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["cache", "original"])
def test_prefill_longer_than_budget_then_decode_matches_reference(mode):
    """A multi-token prefill (attends to the whole prompt) that overflows the budget, then token-by-token decode."""
    model = build_model("llama")
    ids = random_ids(1, 40, seed=3)
    ref = stream_logits(model, ReferenceSinkCache(model.config, 3, 5, mode), ids, prefill=17)
    got = stream_logits(model, SinkCache(model, sinks=3, window=5, position_mode=mode), ids, prefill=17)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_budget_argument_equals_window_argument():
    model = build_model("llama")
    ids = random_ids(1, 30, seed=4)
    a = stream_logits(model, SinkCache(model, sinks=SINKS, window=WINDOW), ids)
    b = stream_logits(model, SinkCache(model, sinks=SINKS, budget=SINKS + WINDOW), ids)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_modes_agree_before_eviction_and_differ_after():
    model = build_model("llama")
    ids = random_ids(1, LENGTH, seed=5)
    cache_mode = stream_logits(model, SinkCache(model, sinks=SINKS, window=WINDOW, position_mode="cache"), ids)
    original = stream_logits(model, SinkCache(model, sinks=SINKS, window=WINDOW, position_mode="original"), ids)
    budget = SINKS + WINDOW
    # Token t (0-based) is fed with t tokens in the past; eviction starts once t + 1 > budget.
    torch.testing.assert_close(cache_mode[:budget], original[:budget], atol=1e-5, rtol=1e-5)
    diff_after = (cache_mode[budget + 1 :] - original[budget + 1 :]).abs().amax(-1)
    assert bool((diff_after > 1e-3).all()), diff_after


def test_reference_modes_differ_too():
    """Guard against a vacuous comparison: the two reference modes themselves disagree after eviction."""
    model = build_model("llama")
    ids = random_ids(1, 30, seed=6)
    a = stream_logits(model, ReferenceSinkCache(model.config, SINKS, WINDOW, "cache"), ids)
    b = stream_logits(model, ReferenceSinkCache(model.config, SINKS, WINDOW, "original"), ids)
    assert (a[SINKS + WINDOW + 1 :] - b[SINKS + WINDOW + 1 :]).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["cache", "original"])
def test_zero_sinks_is_sliding_window(mode):
    model = build_model("llama")
    ids = random_ids(1, 40, seed=7)
    a = stream_logits(model, SinkCache(model, sinks=0, window=7, position_mode=mode), ids)
    b = stream_logits(model, SlidingWindowCache(model, window=7), ids)
    ref = stream_logits(model, ReferenceSinkCache(model.config, 0, 7, mode), ids)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["cache", "original"])
@pytest.mark.parametrize("chunk", [3, 7])
def test_chunks_after_eviction_match_reference(mode, chunk):
    """Multi-token forwards with an evicted past (chunk < window and chunk > window)."""
    model = build_model("llama")
    ids = random_ids(1, 50, seed=8)
    ref = stream_logits(model, ReferenceSinkCache(model.config, 2, 5, mode), ids, prefill=4, chunk=chunk)
    got = stream_logits(model, SinkCache(model, sinks=2, window=5, position_mode=mode), ids, prefill=4, chunk=chunk)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["cache", "original"])
def test_multi_turn_generate_matches_reference(mode):
    """generate twice on the same cache (the second prompt is a chunk fed after evictions)."""
    model = build_model("llama")
    prompt = random_ids(1, 12, seed=9)

    def two_turns(cache):
        first = model.generate(prompt, max_new_tokens=10, do_sample=False, **cache_kwargs(cache))
        second_prompt = torch.cat((first, random_ids(1, 6, seed=10)), -1)
        return model.generate(second_prompt, max_new_tokens=10, do_sample=False, **cache_kwargs(cache))

    ref = two_turns(ReferenceSinkCache(model.config, 3, 5, mode))
    got = two_turns(SinkCache(model.config, sinks=3, window=5, position_mode=mode))
    assert torch.equal(got, ref)


ROPE_VARIANTS = {
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "rope_theta": 500000.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "partial_rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    "head_dim_32": ("qwen3", {"head_dim": 32}),
    "gpt_neox_partial_25": ("gpt_neox", {}),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_reference(variant):
    """Scaled RoPE types, partial rotary and a head_dim that is not hidden/heads. The reference takes the model's
    own inverse frequencies (its rotation convention is checked against transformers above)."""
    arch, overrides = ROPE_VARIANTS[variant]
    model = build_model(arch, **overrides)
    inv_freq = model.base_model.rotary_emb.inv_freq
    ids = random_ids(1, 36, seed=11)
    ref = stream_logits(model, ReferenceSinkCache(model.config, 2, 6, "cache", inv_freq), ids, prefill=5)
    got = stream_logits(model, SinkCache(model, sinks=2, window=6), ids, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # sanity: the positions matter for this model, i.e. the original mode differs
    other = stream_logits(model, SinkCache(model, sinks=2, window=6, position_mode="original"), ids, prefill=5)
    assert (other - ref).abs().max() > 1e-3


@pytest.mark.parametrize(
    "arch,rope_parameters",
    [
        ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        (
            "phi3",
            {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_length_dependent_rope_rejected_in_cache_mode(arch, rope_parameters):
    from conftest import build_config

    config = build_config(arch, rope_parameters=rope_parameters)
    with pytest.raises(ValueError, match="position_mode"):
        SinkCache(config, sinks=2, window=6)
    SinkCache(config, sinks=2, window=6, position_mode="original")  # fine


@pytest.mark.parametrize("mode", ["cache", "original"])
def test_generate_with_prefill_chunks_matches_reference(mode):
    """generate(prefill_chunk_size=...) feeds a long prompt in chunks, evicting between them."""
    model = build_model("llama")
    prompt = random_ids(1, 23, seed=12)
    kw = dict(max_new_tokens=12, do_sample=False, prefill_chunk_size=5)
    ref = model.generate(prompt, **cache_kwargs(ReferenceSinkCache(model.config, 2, 6, mode)), **kw)
    got = model.generate(prompt, **cache_kwargs(SinkCache(model.config, sinks=2, window=6, position_mode=mode)), **kw)
    assert torch.equal(got, ref)
    whole = model.generate(
        prompt,
        **cache_kwargs(SinkCache(model.config, sinks=2, window=6, position_mode=mode)),
        max_new_tokens=12,
        do_sample=False,
    )
    assert not torch.equal(whole, got)  # chunking the prompt really changed what was attended


# -- the rotator per layer (hf_kvcache.common.rope.KeyRotator) on the architectures whose RoPE differs ---------------
import warnings  # noqa: E402

import model_zoo  # noqa: E402

from hf_kvcache import CompositeCache, H2OCache  # noqa: E402
from hf_kvcache.common import rope as rope_module  # noqa: E402
from hf_kvcache.common.architecture import attention_head_dim  # noqa: E402
from hf_kvcache.common.rope import KeyRotator, LayerRope, check_rotator_against_model  # noqa: E402

LATENT = ("deepseek_v3", "minicpm3")  # MLA: re-positioning refused by name (test_support_matrix)
ROPE_ZOO = [a for a in model_zoo.ZOO if a not in LATENT]
#: what each model's attention does to the keys of the layers our caches compress, read from its modeling file:
#: {layer: None (no RoPE) or (convention, rotary dims)}
EXPECTED_PLANS = {
    "smollm3": {0: ("half", 16), 1: None},  # no_rope_layers = [1, 0]: `if self.use_rope`
    "cohere2": {1: None},  # layer 0 slides (RoPE), layer 1 full: `if self.sliding_window is not None`
    "glm4": {0: ("interleaved", 8), 1: ("interleaved", 8)},  # partial_rotary_factor 0.5, x[..., 0::2] pairs
    "phi3": {0: ("half", 12), 1: ("half", 12)},  # partial 0.75
    "gpt_neox": {0: ("half", 4), 1: ("half", 4)},  # partial 0.25
    "gemma3": {1: ("half", 16)},  # layer 0 slides
    "llama": {0: ("half", 16), 1: ("half", 16)},
}


def _plans(rotator):
    return {i: None if p is None else (p.convention, p.rotary_dim) for i, p in rotator.layers.items()}


@pytest.mark.parametrize("arch", list(EXPECTED_PLANS))
def test_rotator_plan_per_layer_follows_the_architecture(arch):
    model = model_zoo.build(arch)
    rotator = KeyRotator(model.config)
    assert _plans(rotator) == EXPECTED_PLANS[arch]
    if arch == "gemma3":  # the full-attention layers' own RoPE base (1M), not the sliding layers' (10K)
        torch.testing.assert_close(rotator.layers[1].inv_freq, model.model.rotary_emb.full_attention_inv_freq)
    elif arch != "cohere2":
        first = next(p for p in rotator.layers.values() if p is not None)
        torch.testing.assert_close(first.inv_freq, model.base_model.rotary_emb.inv_freq)


@pytest.mark.parametrize("arch", ROPE_ZOO)
def test_rotator_reproduces_the_models_own_keys(arch):
    """The model's keys at p + d equal the rotator's rotation of its keys at p, on every compressed layer, for every
    RoPE architecture of the zoo (llama3/yarn scaling, partial and interleaved RoPE, NoPE layers, per-type bases)."""
    model = model_zoo.build(arch)
    rotator = KeyRotator(model.config)
    errors = check_rotator_against_model(model, rotator)
    assert sorted(errors) == sorted(rotator.layers)
    assert all(error <= 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("model_type", ["exaone4", "exaone_moe", "kolibri1", "flint", "cohere2"])
def test_models_whose_full_layers_have_no_rope_are_planned_so(model_type):
    """EXAONE 4 / EXAONE-MoE / Kolibri (`if self.sliding_window is None or self.is_sliding`) and Flint / Cohere2
    (`if self.sliding_window is not None`) rotate only their sliding layers' keys: the full layers, the ones our
    caches compress, are NoPE, and the rotator reproduces the model's own keys there (a rotate-half plan was off by
    ~1 and refused by the first forward's check)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=256,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    rotator = KeyRotator(model.config)
    assert _plans(rotator) == {1: None}  # layer 0 slides (transformers' own layer), layer 1 is NoPE
    errors = check_rotator_against_model(model, rotator)
    assert list(errors) == [1] and errors[1] <= 1e-5, errors


def _one_rotate_half_for_all(rotator, model) -> None:
    """What KeyRotator did before it knew layers: the rotate-half RoPE of the config on every compressed layer."""
    head_dim = attention_head_dim(model.config)
    inv_freq = next(
        (p.inv_freq for p in rotator.layers.values() if p is not None),
        1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2) / head_dim)),
    )
    rotator.layers = {i: LayerRope(inv_freq.float(), "half") for i in rotator.layers}


@pytest.mark.parametrize("arch,layer", [("smollm3", 1), ("cohere2", 1), ("glm4", 0)])
def test_check_catches_the_single_rotate_half_rotator(arch, layer):
    """The three architectures the support matrix found broken: the old behaviour fails the check, naming the
    model class and the first wrong layer, by far more than the tolerance (errors ~1, not rounding)."""
    model = model_zoo.build(arch)
    rotator = KeyRotator(model.config)
    _one_rotate_half_for_all(rotator, model)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} layer {layer}: .*relative error (\S+) >") as info:
        check_rotator_against_model(model, rotator)
    error = float(str(info.value).split("relative error ")[1].split()[0])
    assert error > 0.3
    # and an identity everywhere is caught on layers that do have RoPE
    if arch != "cohere2":
        rotator.layers = {i: None for i in rotator.layers}
        with pytest.raises(ValueError, match=r"layer \d: re-rotating cached keys .* with no RoPE"):
            check_rotator_against_model(model, rotator)


def test_rotation_composes_and_inverts_in_both_conventions():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 5, 16, generator=g)
    d1, d2 = torch.randint(-50, 50, (2, 5), generator=g), torch.randint(-50, 50, (2, 5), generator=g)
    for arch in ("glm4", "llama"):
        rotator = KeyRotator(model_zoo.build(arch).config)
        once = rotator.rotate(rotator.rotate(keys, d1, 0), d2, 0)
        torch.testing.assert_close(once, rotator.rotate(keys, d1 + d2, 0), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rotator.rotate(rotator.rotate(keys, d1, 0), -d1, 0), keys, atol=1e-5, rtol=1e-5)
        moved = rotator.rotate(keys, d1, 0)
        rot = rotator.layers[0].rotary_dim
        assert torch.equal(moved[..., rot:], keys[..., rot:])  # pass-through dims untouched (GLM-4: 8 of 16)
        assert (moved[..., :rot] - keys[..., :rot]).abs().max() > 0.1


def test_layers_without_rope_cost_nothing_and_other_layers_are_refused():
    rotator = KeyRotator(model_zoo.build("cohere2").config)
    keys = torch.randn(1, 2, 3, 16)
    assert rotator.rotate(keys, torch.full((1, 3), 7), 1) is keys  # the very tensor: no work, no copy
    assert not rotator.applies(1)
    with pytest.raises(ValueError, match=r"`layer_idx` 0 .*'full_attention' layers \[1\]"):
        rotator.rotate(keys, torch.full((1, 3), 7), 0)  # a sliding layer: our caches never move its keys


@pytest.mark.parametrize("arch", ["smollm3", "glm4", "cohere2"])
def test_stream_matches_reference_with_the_models_rope(arch):
    """One token per forward, then chunks, after eviction: SinkCache equals the from-scratch reference given the
    convention read from the modeling file (interleaved pairs for GLM-4, NoPE layers kept as they arrived)."""
    model = model_zoo.build(arch)
    config = model.config
    kwargs = dict(inv_freq=model.base_model.rotary_emb.inv_freq)
    if arch == "glm4":
        kwargs["interleaved"] = True
    if arch == "smollm3":
        kwargs["rope_layers"] = [bool(x) for x in config.no_rope_layers]
    if arch == "cohere2":
        kwargs["rope_layers"] = [t == "sliding_attention" for t in config.layer_types]
        kwargs["interleaved"] = True
    ids = random_ids(1, 40, seed=13)
    for prefill, chunk in ((1, 1), (9, 3)):
        ref = stream_logits(model, ReferenceSinkCache(config, 2, 6, "cache", **kwargs), ids, prefill, chunk)
        got = stream_logits(model, SinkCache(model, sinks=2, window=6), ids, prefill, chunk)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    if arch != "cohere2":  # positions matter (cohere2's compressed layer has none: both modes are the same cache)
        other = stream_logits(model, SinkCache(model, sinks=2, window=6, position_mode="original"), ids, 9, 3)
        assert (other - ref).abs().max() > 1e-3
    # a wrong convention in the reference really changes the stream (the comparison is not vacuous)
    if arch == "glm4":
        wrong = stream_logits(model, ReferenceSinkCache(config, 2, 6, "cache", kwargs["inv_freq"]), ids, 9, 3)
        assert (wrong - ref).abs().max() > 1e-3


def _wrong_convention(monkeypatch):
    """Make the rotator believe GLM-4 pairs halves: what the check exists to catch."""
    monkeypatch.setattr(rope_module, "INTERLEAVED_MODEL_TYPES", rope_module.INTERLEAVED_MODEL_TYPES - {"glm4"})


@pytest.mark.parametrize(
    "build",
    [
        lambda m: SinkCache(m, sinks=2, window=6),
        lambda m: H2OCache(m, heavy=4, recent=4, position_mode="compact"),
        lambda m: CompositeCache(m, regions=[{"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 6}]),
        lambda m: CompositeCache(
            m,
            regions=[{"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 6}],
            layers={0: {"cache": "sink", "sinks": 2, "window": 6}},
        ),
    ],
    ids=["sink", "h2o_compact", "composite", "composite_with_a_sink_layer"],
)
def test_caches_built_with_a_model_check_the_rotation(monkeypatch, build):
    _wrong_convention(monkeypatch)
    model = model_zoo.build("glm4")
    with pytest.raises(ValueError, match=r"Glm4ForCausalLM layer 0: .*half RoPE on the first 8 of 16 dims"):
        build(model)


def test_no_check_without_a_model_or_without_re_rotation(monkeypatch):
    _wrong_convention(monkeypatch)
    model = model_zoo.build("glm4")
    calls = []
    monkeypatch.setattr(rope_module, "check_rotator_against_model", lambda *a, **k: calls.append(a))
    SinkCache(model.config, sinks=2, window=6)  # a config: nothing to run
    SinkCache(model, sinks=2, window=6, position_mode="original")
    H2OCache(model, heavy=4, recent=4)  # original positions
    CompositeCache(
        model,
        regions=[{"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 6}],
        sink_positions="original",
    )
    assert calls == []


def test_check_runs_once_per_model_and_rotator(monkeypatch):
    model = model_zoo.build("smollm3")
    calls = []
    real = rope_module.check_rotator_against_model
    monkeypatch.setattr(rope_module, "check_rotator_against_model", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    SinkCache(model, sinks=2, window=6)
    SinkCache(model, sinks=4, window=10)  # same rotator: already checked
    assert calls == [[0, 1]]
    SinkCache(model_zoo.build("smollm3"), sinks=2, window=6)  # another model: checked again
    assert len(calls) == 2


def test_check_skips_a_model_without_weights_with_a_reason():
    config = model_zoo.build("glm4").config
    with torch.device("meta"):
        model = type(model_zoo.build("glm4"))(config)
    with pytest.warns(UserWarning, match="Glm4ForCausalLM: its weights are not loaded"):
        errors = check_rotator_against_model(model, KeyRotator(config))
    assert errors == {}


def test_check_in_bfloat16_passes_the_right_rotator_and_catches_the_wrong_one():
    model = model_zoo.build("glm4", dtype=torch.bfloat16)
    rotator = KeyRotator(model.config)
    errors = check_rotator_against_model(model, rotator)
    assert all(error < rope_module.RELATIVE_TOLERANCE[torch.bfloat16] / 3 for error in errors.values()), errors
    _one_rotate_half_for_all(rotator, model)
    with pytest.raises(ValueError, match="Glm4ForCausalLM layer 0"):
        check_rotator_against_model(model, rotator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip on a model that runs
        check_rotator_against_model(model, KeyRotator(model.config))
