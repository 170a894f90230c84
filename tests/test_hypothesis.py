"""Property tests on a tiny model (the per-layer references of every cache are in tests/test_properties.py):
- sink / sliding caches: whatever the sizes, padding and decode chunks, each row keeps exactly its first S and last
  W real tokens (two-layer model, generate-style positions);
- attention uses exactly the tokens the cache says it holds: on a one-layer model the cache run's logits equal a
  no-cache forward of the whole history masked per row and KV head to the cache's held tokens (sliding, sinks with
  original positions, h2o, random_eviction, composite sinks + window + heavy), through prefill, chunks and decode."""

from __future__ import annotations

import torch
from conftest import build_model, left_pad, random_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_kvcache
from hf_kvcache import SinkCache, SlidingWindowCache, cache_kwargs

_MODEL = None


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = hf_kvcache.enable(build_model("llama", num_hidden_layers=2))
    return _MODEL


def expected_positions(n_real: int, sinks: int, window: int) -> set[int]:
    """Positions (= real-token index, as generate assigns them under left padding) of first S + last W."""
    return set(range(min(sinks, n_real))) | set(range(max(0, n_real - window), n_real))


def stored_positions(layer, row: int) -> set[int]:
    valid = layer.slot_valid[row, 0, :-1]  # the last slot is the trash slot
    return set(layer.head_positions()[row, 0, :-1][valid].tolist())


@st.composite
def scenarios(draw):
    kind = draw(st.sampled_from(["sink_cache", "sink_original", "sliding"]))
    sinks = 0 if kind == "sliding" else draw(st.integers(0, 4))
    window = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 16), min_size=batch, max_size=batch))
    steps = draw(st.integers(0, 14))
    chunk = draw(st.sampled_from([1, 1, 3]))  # decode one token per forward, or in small chunks
    seed = draw(st.integers(0, 2**16))
    return kind, sinks, window, lengths, steps, chunk, seed


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_kept_tokens_are_first_sinks_and_last_window(scenario):
    kind, sinks, window, lengths, steps, chunk, seed = scenario
    model = tiny_model()
    if kind == "sliding":
        cache = SlidingWindowCache(model.config, window=window)
    else:
        mode = "cache" if kind == "sink_cache" else "original"
        cache = SinkCache(model.config, sinks=sinks, window=window, position_mode=mode)
    budget = sinks + window

    rows = [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_pad(rows)
    batch = len(rows)
    n_real = torch.tensor(lengths)

    def check():
        for layer in cache.layers:
            assert layer.slot_valid.shape[-1] == budget + 1
            assert not layer.slot_valid[..., -1].any()
            for b in range(batch):
                got = stored_positions(layer, b)
                want = expected_positions(int(n_real[b]), sinks, window)
                assert got == want, (b, int(n_real[b]), sorted(got), sorted(want))
                # each kept position is stored exactly once
                assert int(layer.slot_valid[b, 0, :-1].sum()) == len(want)
        assert cache.get_seq_length() == mask.shape[1]

    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
        allocated = cache.nbytes()
        assert allocated > 0
        check()
        done = 0
        while done < steps:
            q = min(chunk, steps - done)
            new = random_ids(batch, q, seed=seed + 100 + done)
            mask = torch.cat((mask, torch.ones(batch, q, dtype=torch.long)), -1)
            new_pos = n_real[:, None] + torch.arange(q)[None]
            model(new, attention_mask=mask, position_ids=new_pos, **cache_kwargs(cache), use_cache=True)
            n_real = n_real + q
            done += q
            check()
            # a fixed-budget cache never grows past what it held at the start (already the full budget)
            assert cache.nbytes() <= allocated
        assert cache.nbytes() == allocated


# -- model level: attention uses exactly the tokens the cache says it holds ---------------------------------------
# On a one-layer model the keys and values of every token depend only on its embedding and position, so a forward of
# the whole history without a cache, whose attention is masked per row and KV head to the tokens the cache held when
# it attended (the stored ones before a multi-token chunk plus the chunk itself, causally; the stored ones after a
# one-token step, whose eviction comes first), must give the cache run's logits. Caches with original positions and
# full precision only (moved positions and quantization are checked per layer in tests/test_properties.py).
from transformers import AttentionInterface  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

from hf_kvcache import CompositeCache, H2OCache  # noqa: E402
from hf_kvcache.caches.eviction import RandomEvictionCache  # noqa: E402

_ALLOWED: dict[str, torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, **kwargs):
    allowed = _ALLOWED["mask"]  # [B, Hkv, T, T]
    allowed = allowed.repeat_interleave(query.shape[1] // allowed.shape[1], dim=1)
    additive = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(~allowed, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, additive, **kwargs)


AttentionInterface.register("test_held_tokens", _masked_attention)
_PAIR = None


def one_layer_models():
    global _PAIR
    if _PAIR is None:
        cached = hf_kvcache.enable(build_model("llama", attn="eager", num_hidden_layers=1))
        reference = build_model("llama", attn="eager", num_hidden_layers=1)
        reference.set_attn_implementation("test_held_tokens")
        _PAIR = cached, reference
    return _PAIR


def held_streams(layer, stream_of) -> list[list[set[int]]]:
    """Per row and KV head, the stream indices of the tokens the layer holds (from its slot positions)."""
    valid, pos = layer.slot_valid[..., :-1], layer.head_positions()[..., :-1]
    heads = layer.heads
    return [
        [
            {
                stream_of[b][int(p)]
                for p in pos[b, h if valid.shape[1] > 1 else 0][valid[b, h if valid.shape[1] > 1 else 0]].tolist()
            }
            for h in range(heads)
        ]
        for b in range(valid.shape[0])
    ]


@st.composite
def model_scenarios(draw):
    kind = draw(st.sampled_from(["sliding", "sink_original", "h2o", "random_eviction", "composite"]))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 10), min_size=batch, max_size=batch))
    chunks = draw(st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=1, max_size=8))
    sizes = (draw(st.integers(0, 3)), draw(st.integers(1, 4)))
    return kind, sizes, lengths, chunks, draw(st.integers(0, 2**16))


def build_cache(kind, sizes, config):
    a, b = sizes
    if kind == "sliding":
        return SlidingWindowCache(config, window=b)
    if kind == "sink_original":
        return SinkCache(config, sinks=a, window=b, position_mode="original")
    if kind == "h2o":
        return H2OCache(config, heavy=a, recent=b)
    if kind == "random_eviction":
        return RandomEvictionCache(config, heavy=a, recent=b, seed=a + b)
    regions = ([{"role": "sinks", "tokens": a}] if a else []) + [
        {"role": "window", "start": 0, "end": b},
        {"role": "heavy", "tokens": 2},
    ]
    return CompositeCache(config, regions=regions, sink_positions="original")


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(model_scenarios())
def test_attention_uses_exactly_the_held_tokens(scenario):
    kind, sizes, lengths, chunks, seed = scenario
    model, reference = one_layer_models()
    cache = build_cache(kind, sizes, model.config)
    layer = cache.layers[0]
    rows = [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_pad(rows)
    batch = len(rows)
    with torch.no_grad():
        for step, q in enumerate([ids.shape[1]] + chunks):
            if step:
                ids = torch.cat((ids, random_ids(batch, q, seed=seed + 100 + step)), -1)
                mask = torch.cat((mask, torch.ones(batch, q, dtype=torch.long)), -1)
            total = ids.shape[1]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            stream_of = [{int(positions[b, t]): t for t in range(total) if mask[b, t]} for b in range(batch)]
            before = held_streams(layer, stream_of) if step else None
            out = model(
                ids[:, -q:], attention_mask=mask, position_ids=positions[:, -q:], **cache_kwargs(cache), use_cache=True
            ).logits
            allowed = torch.eye(total, dtype=torch.bool).expand(batch, layer.heads, total, total).clone()
            held = held_streams(layer, stream_of) if q == 1 and step else before
            for b in range(batch):
                for h in range(layer.heads):
                    for i in range(total - q, total):
                        if not mask[b, i]:
                            continue
                        if held is not None:
                            allowed[b, h, i, sorted(held[b][h])] = True
                        if q > 1 or not step:
                            new = [t for t in range(total - q, i + 1) if mask[b, t]]
                            allowed[b, h, i, new] = True
            _ALLOWED["mask"] = allowed
            want = reference(ids, position_ids=positions).logits[:, -q:]
            real = mask[:, -q:].bool()
            torch.testing.assert_close(out[real], want[real], atol=1e-4, rtol=1e-4)
