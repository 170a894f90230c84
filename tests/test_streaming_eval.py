"""The StreamingLLM perplexity harness (hf_kvcache.evaluation.streaming) on a tiny random Llama."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build_model, random_ids
from transformers import DynamicCache

from hf_kvcache import FullCache, SinkCache
from hf_kvcache.evaluation.streaming import bucket_perplexity, load_checkpoint, perplexity, read_progress, stream_nll

N = 48


@pytest.fixture
def tiny():
    return build_model("llama", seed=3)


@pytest.fixture
def ids():
    return random_ids(1, N, seed=5)


def reference_nlls(model, ids) -> np.ndarray:
    """NLLs from one full-sequence forward: -log_softmax(logits[t])[ids[t + 1]]."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1)
    return (-logp.gather(-1, ids[0, 1:, None])[:, 0]).numpy()


@pytest.mark.parametrize("factory", ["full", "dynamic"])
def test_stream_matches_full_forward(tiny, ids, factory):
    make = {"full": lambda: FullCache(tiny), "dynamic": lambda: DynamicCache(config=tiny.config)}[factory]
    got = stream_nll(tiny, ids, make, progress=False)
    assert got.dtype == np.float64 and got.shape == (N - 1,)
    np.testing.assert_allclose(got, reference_nlls(tiny, ids), atol=1e-4, rtol=0)


def test_bucket_perplexity():
    rng = np.random.default_rng(0)
    nlls = rng.uniform(0.5, 4.0, size=2500)
    rows = bucket_perplexity(nlls, bucket=1000)
    assert [(r["bucket_start"], r["bucket_end"], r["tokens"]) for r in rows] == [
        (0, 1000, 1000),
        (1000, 2000, 1000),
        (2000, 2500, 500),
    ]
    for r in rows:
        assert r["ppl"] == pytest.approx(math.exp(nlls[r["bucket_start"] : r["bucket_end"]].mean()), rel=1e-12)
    assert perplexity(nlls) == pytest.approx(math.exp(nlls.mean()), rel=1e-12)


def sink_factory(model):
    return lambda: SinkCache(model, sinks=2, window=10)  # budget 12 < 48 tokens: evicts, re-rotates sinks


def test_resume_from_explicit_stop(tiny, ids, tmp_path):
    full = stream_nll(tiny, ids, sink_factory(tiny), progress=False)
    ckpt = tmp_path / "run.pt"
    part = stream_nll(
        tiny, ids, sink_factory(tiny), checkpoint=ckpt, checkpoint_every=7, stop_after=25, tag="s", progress=False
    )
    assert part.shape == (25,)
    state = load_checkpoint(ckpt)
    assert state["meta"]["done"] == 25 and state["cache"].get_seq_length() == 25
    nlls, _meta = read_progress(ckpt)
    np.testing.assert_array_equal(nlls, part)
    # A fresh model object (as in a new process): the bridge must be re-enabled from the checkpoint path.
    fresh = build_model("llama", seed=3)
    resumed = stream_nll(fresh, ids, sink_factory(fresh), checkpoint=ckpt, tag="s", progress=False)
    np.testing.assert_array_equal(resumed, full)
    assert read_progress(ckpt)[1]["done"] == N - 1


def test_resume_after_crash_mid_forward(tiny, ids, tmp_path):
    """A crash inside a forward leaves the in-memory cache half-updated; the run resumes from the last periodic
    checkpoint and still gives the uninterrupted NLLs."""
    full = stream_nll(tiny, ids, sink_factory(tiny), progress=False)
    ckpt = tmp_path / "run.pt"
    model = build_model("llama", seed=3)
    calls = {"n": 0}

    def boom(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 31:
            raise KeyboardInterrupt

    model.model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)  # after layer 0 was updated
    with pytest.raises(KeyboardInterrupt):
        stream_nll(model, ids, sink_factory(model), checkpoint=ckpt, checkpoint_every=8, progress=False)
    assert read_progress(ckpt)[1]["done"] == 24
    fresh = build_model("llama", seed=3)
    np.testing.assert_array_equal(stream_nll(fresh, ids, sink_factory(fresh), checkpoint=ckpt, progress=False), full)


def test_checkpoint_refuses_other_tokens_or_tag(tiny, ids, tmp_path):
    ckpt = tmp_path / "run.pt"
    stream_nll(tiny, ids, sink_factory(tiny), checkpoint=ckpt, stop_after=10, tag="a", progress=False)
    with pytest.raises(ValueError, match="is for"):
        stream_nll(tiny, ids, sink_factory(tiny), checkpoint=ckpt, tag="b", progress=False)
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 128
    with pytest.raises(ValueError, match="different tokens"):
        stream_nll(tiny, other, sink_factory(tiny), checkpoint=ckpt, tag="a", progress=False)


def test_checkpoint_refuses_changed_code(tiny, ids, tmp_path):
    ckpt = tmp_path / "run.pt"
    stream_nll(tiny, ids, sink_factory(tiny), checkpoint=ckpt, stop_after=10, progress=False)
    state = load_checkpoint(ckpt)
    assert len(state["meta"]["code_digest"]) == 40
    state["meta"]["code_digest"] = "0" * 40  # as if the policy's source had changed since
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match="other hf_kvcache code"):
        stream_nll(tiny, ids, sink_factory(tiny), checkpoint=ckpt, progress=False)
    resumed = stream_nll(tiny, ids, sink_factory(tiny), checkpoint=ckpt, allow_code_change=True, progress=False)
    assert resumed.shape == (N - 1,)
