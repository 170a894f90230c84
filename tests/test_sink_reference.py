"""SinkCache against a direct, slow reference implementation of StreamingLLM written here from scratch.

The reference keeps keys UN-rotated (RoPE undone with each token's absolute position as it arrives), keeps the first
S and last W tokens with plain torch.cat, and on each update re-rotates every kept key. In "cache" mode the L kept
keys go to positions (p_query - L + 1 + slot), slot = 0..L-1: by RoPE relativity this is StreamingLLM's in-cache
positions 0..L-1 with the query at L-1. In "original" mode each key keeps the position it arrived at.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from conftest import build_model, random_ids
from hf_kvcache import SinkCache, SlidingWindowCache


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, inv_freq: torch.Tensor | None = None):
    """Rotate-half RoPE of x [B, H, n, D] to positions [n] (float64 for a clean reference). By default the standard
    frequencies theta^(-2i/D) over the whole head; `inv_freq` overrides them (scaled RoPE types, partial rotary:
    only the first 2 * len(inv_freq) dims rotate)."""
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
    half = rot // 2
    rotated_half = torch.cat((-xr[..., half:], xr[..., :half]), -1)
    return torch.cat((xr * cos + rotated_half * sin, rest), -1)


class ReferenceSinkLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, sinks: int, window: int, theta: float, mode: str, inv_freq=None):
        super().__init__()
        self.sinks, self.window, self.theta, self.mode, self.inv_freq = sinks, window, theta, mode, inv_freq
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
        plain = rope_rotate(key_states, -new_pos, self.theta, self.inv_freq)
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
        return rope_rotate(self.k_plain, target, self.theta, self.inv_freq).to(self.dtype)

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
    def __init__(self, config, sinks: int, window: int, mode: str = "cache", inv_freq=None):
        theta = config.rope_parameters["rope_theta"]
        layers = [ReferenceSinkLayer(sinks, window, theta, mode, inv_freq) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)


def stream_logits(model, cache, ids: torch.Tensor, prefill: int = 1, chunk: int = 1) -> torch.Tensor:
    """Prefill `prefill` tokens, then `chunk` tokens per forward; logits of every position [T, V]."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits[0])
        for t in range(prefill, ids.shape[1], chunk):
            out.append(model(ids[:, t : t + chunk], past_key_values=cache, use_cache=True).logits[0])
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
        first = model.generate(prompt, max_new_tokens=10, do_sample=False, past_key_values=cache)
        second_prompt = torch.cat((first, random_ids(1, 6, seed=10)), -1)
        return model.generate(second_prompt, max_new_tokens=10, do_sample=False, past_key_values=cache)

    ref = two_turns(ReferenceSinkCache(model.config, 3, 5, mode))
    got = two_turns(SinkCache(model.config, sinks=3, window=5, position_mode=mode))
    assert torch.equal(got, ref)


ROPE_VARIANTS = {
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}}),
    "yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 64}}),
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


@pytest.mark.parametrize("arch,rope_parameters", [
    ("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
              "original_max_position_embeddings": 64}),
])
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
    ref = model.generate(prompt, past_key_values=ReferenceSinkCache(model.config, 2, 6, mode), **kw)
    got = model.generate(prompt, past_key_values=SinkCache(model.config, sinks=2, window=6, position_mode=mode), **kw)
    assert torch.equal(got, ref)
    whole = model.generate(prompt, past_key_values=SinkCache(model.config, sinks=2, window=6, position_mode=mode),
                           max_new_tokens=12, do_sample=False)
    assert not torch.equal(whole, got)  # chunking the prompt really changed what was attended
