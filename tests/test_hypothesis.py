"""Property test: whatever the sizes and padding, each row keeps exactly its first S and last W real tokens."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_kvcache
from conftest import build_model, left_pad, random_ids
from hf_kvcache import SinkCache, SlidingWindowCache

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
    return set(layer.slot_pos[row, 0, :-1][valid].tolist())


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


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
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
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        allocated = cache.nbytes()
        assert allocated > 0
        check()
        done = 0
        while done < steps:
            q = min(chunk, steps - done)
            new = random_ids(batch, q, seed=seed + 100 + done)
            mask = torch.cat((mask, torch.ones(batch, q, dtype=torch.long)), -1)
            new_pos = n_real[:, None] + torch.arange(q)[None]
            model(new, attention_mask=mask, position_ids=new_pos, past_key_values=cache, use_cache=True)
            n_real = n_real + q
            done += q
            check()
            # a fixed-budget cache never grows past what it held at the start (already the full budget)
            assert cache.nbytes() <= allocated
        assert cache.nbytes() == allocated
