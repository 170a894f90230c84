"""The scorer policies (issue 14): each scorer's per-token scores equal a direct computation of its paper's / kvpress's
formula from an eager forward on a tiny model (keys, values, attention probabilities, hidden states); padding rows
score like the row alone; scorers that need no attention never ask the bridge for it; each runs through generate in
both compression modes with a left-padded batch, every row as if alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import PAD, build_model, left_pad, random_ids
from transformers import DynamicCache

from hf_kvcache import CACHE_IMPLEMENTATIONS, cache_kwargs
from hf_kvcache.scorers.base import group_mean

N = 24  # prompt length; budgets >= N keep every token, so every token's score is stored in slot = its index
LAYER = 1
SCORERS = ("knorm", "keydiff", "tova", "snapkv", "expected_attention")


def _eager_forward(model, ids):
    """Keys, values, attention probabilities and the attention input hidden states of layer LAYER."""
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)

    handle = model.model.layers[LAYER].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(cache), output_attentions=True)
    handle.remove()
    return cache.layers[LAYER].keys, cache.layers[LAYER].values, out.attentions[LAYER], captured["hidden"]


def _scores(model, name, ids, mask=None, **config):
    cache = CACHE_IMPLEMENTATIONS[name](model, budget=ids.shape[1], **config)
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
    return cache.layers[LAYER].policy.scores[..., : ids.shape[1]]


@pytest.fixture(scope="module")
def eager():
    model = build_model("llama", attn="eager")
    ids = random_ids(1, N, seed=3)
    return model, ids, _eager_forward(model, ids)


def test_knorm_is_minus_key_norm(eager):
    model, ids, (keys, _, _, _) = eager
    torch.testing.assert_close(_scores(model, "knorm", ids), -keys.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_keydiff_is_minus_cosine_to_the_mean_unit_key(eager):
    model, ids, (keys, _, _, _) = eager
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    torch.testing.assert_close(
        _scores(model, "keydiff", ids), -F.cosine_similarity(keys, anchor, dim=-1), atol=1e-5, rtol=1e-5
    )


def test_tova_is_the_last_querys_attention_averaged_over_all_heads(eager):
    model, ids, (keys, _, attn, _) = eager
    expected = attn[:, :, -1, :].mean(1, keepdim=True).expand(-1, keys.shape[1], -1)
    torch.testing.assert_close(_scores(model, "tova", ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,kernel", [(4, 5), (6, 3)])
def test_snapkv_is_the_pooled_window_attention_group_mean(eager, window, kernel):
    model, ids, (keys, _, attn, _) = eager
    votes = attn[:, :, -window:, :-window].mean(dim=-2)  # kvpress SnapKVPress, step by step
    votes = F.avg_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
    expected = group_mean(votes, keys.shape[1])
    got = _scores(model, "snapkv", ids, window=window, kernel=kernel)[..., :-window]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _kvpress_expected_attention(model, hidden, keys, values, sinks=4, future=16):
    """kvpress ExpectedAttentionPress.score, written out (Llama: no q bias, no QK norm)."""
    attn = model.model.layers[LAYER].self_attn
    n, d = model.config.num_attention_heads, attn.head_dim
    bsz, q_len, _ = hidden.shape
    h = hidden[:, sinks:]
    wq = attn.q_proj.weight
    mean_h = h.mean(dim=1, keepdim=True)
    mu = (mean_h @ wq.T).squeeze(1).view(bsz, n, d)
    centred = h - mean_h
    cov = centred.transpose(1, 2) @ centred / centred.shape[1]
    cov = (wq @ cov @ wq.T).view(bsz, n, d, n, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
    position_ids = torch.arange(q_len, q_len + future)[None]
    cos, sin = model.model.rotary_emb(mu, position_ids)
    cos, sin = cos[0], sin[0]
    eye = torch.eye(d)
    p = torch.zeros(d, d)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    r = (cos[:, :, None] * eye + sin[:, :, None] * p).mean(0)
    mu, cov = mu @ r.T, r @ cov @ r.T
    k, v = keys[:, :, sinks:], values[:, :, sinks:]
    groups = n // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1).transpose(2, 3)
    scores = (mu[:, :, None] @ kk)[:, :, 0] / math.sqrt(d)
    scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", kk, cov, kk) / d / 2
    scores = torch.softmax(scores, dim=-1).view(bsz, k.shape[1], groups, -1).mean(2)
    return scores * v.norm(dim=-1)


def test_expected_attention_equals_kvpress_formula(eager):
    model, ids, (keys, values, _, hidden) = eager
    expected = _kvpress_expected_attention(model, hidden, keys, values)
    got = _scores(model, "expected_attention", ids, future=16)
    assert torch.isinf(got[..., :4]).all()  # sinks are protected
    torch.testing.assert_close(got[..., 4:], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", SCORERS)
def test_a_left_padded_row_scores_like_the_row_alone(name):
    model = build_model("llama")
    config = {"window": 4} if name == "snapkv" else {"future": 16} if name == "expected_attention" else {}
    short, long = random_ids(1, 14, seed=5)[0], random_ids(1, 20, seed=6)[0]
    ids, mask = left_pad([long, short])
    batched = _scores(model, name, ids, mask, **config)[1:, :, ids.shape[1] - short.numel() :]
    cache = CACHE_IMPLEMENTATIONS[name](model, budget=ids.shape[1], **config)
    with torch.no_grad():
        model(input_ids=short[None], **cache_kwargs(cache))
    alone = cache.layers[LAYER].policy.scores[..., : short.numel()]
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ("knorm", "keydiff", "expected_attention"))
def test_scorers_without_attention_never_compute_it(name, monkeypatch):
    import hf_kvcache.attention.bridge as bridge

    def refuse(*args, **kwargs):
        raise AssertionError("attention probabilities computed for a scorer that needs none")

    monkeypatch.setattr(bridge, "attention_column_scores", refuse)
    model = build_model("llama")
    out = model.generate(
        random_ids(1, 20), max_new_tokens=6, do_sample=False, cache_implementation=name, cache_config={"budget": 8}
    )
    assert out.shape == (1, 26)


PROMPTS = (12, 19, 15)


@pytest.mark.parametrize("compress", ["always", "prompt"])
@pytest.mark.parametrize("name", SCORERS)
def test_left_padded_batch_generates_each_row_as_alone(name, compress):
    model = build_model("llama")
    config = {"budget": 8, "compress": compress}
    if name == "snapkv":
        config["window"] = 3
    if name == "expected_attention":
        config["future"] = 16
    rows = [random_ids(1, n, seed=40 + n)[0] for n in PROMPTS]
    ids, mask = left_pad(rows)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, cache_implementation=name, cache_config=config)
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    full = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    assert not torch.equal(batched, full[:, ids.shape[1] :])  # the budget of 8 really evicts
    for i, row in enumerate(rows):
        alone = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, row.numel() :]), f"row {i}"


@pytest.mark.parametrize("name", SCORERS)
def test_bad_settings_name_the_parameter(name):
    config = build_model("llama").config
    cls = CACHE_IMPLEMENTATIONS[name]
    with pytest.raises(ValueError, match="budget"):
        cls(config)
    with pytest.raises(ValueError, match="compress"):
        cls(config, budget=100, compress="sometimes")
    with pytest.raises(ValueError, match="budget"):
        cls(config, budget=1.5)
    recent = "window" if name == "snapkv" else "recent"
    with pytest.raises(ValueError, match=recent):
        cls(config, budget=4, **{recent: 6})


@pytest.mark.parametrize("name", SCORERS)
def test_decode_time_eviction_protects_half_the_budget_by_default(name):
    """ "always" mode keeps at least DECODE_RECENT_SHARE of the budget (Knorm: KNORM_DECODE_RECENT_SHARE) as a recent
    window when `recent` is unset (the scorers' paper windows let decode-time eviction drop the newest tokens:
    eval/results/scorers); prompt mode keeps the paper's window; a given `recent` is used as given."""
    from hf_kvcache.caches.scorers import DECODE_RECENT_SHARE, KNORM_DECODE_RECENT_SHARE

    share = KNORM_DECODE_RECENT_SHARE if name == "knorm" else DECODE_RECENT_SHARE

    model = build_model("llama")
    cls = CACHE_IMPLEMENTATIONS[name]
    extra = {"window": 2} if name == "snapkv" else {}
    paper = {"tova": 1, "snapkv": 2}.get(name, 0)
    for budget, prompt_len in ((12, 20), (0.5, 24)):
        caches = {mode: cls(model, budget=budget, compress=mode, **extra) for mode in ("always", "prompt")}
        given = cls(model, budget=budget, recent=paper, **extra)
        ids = random_ids(1, prompt_len)
        for cache in (*caches.values(), given):
            with torch.no_grad():
                model(input_ids=ids, **cache_kwargs(cache))
        tokens = budget if isinstance(budget, int) else int(budget * prompt_len)
        policy = caches["always"].layers[0].policy
        window = {0.5: tokens // 2, 0.75: tokens * 3 // 4}[share]  # (12 and 0.5 x 24 tokens: exact shares)
        assert policy.recent == max(paper, round(share * tokens)) == window
        assert policy.heavy == tokens - window
        assert caches["prompt"].layers[0].policy.inner.recent == paper
        assert given.layers[0].policy.recent == paper


@pytest.mark.parametrize("name", ["keydiff", "snapkv", "expected_attention"])
def test_rescore_every_n_steps(name, monkeypatch):
    from hf_kvcache.policies.scored import ScoredPolicy

    model = build_model("llama")
    extra = {"window": 2} if name == "snapkv" else {}
    policy = CACHE_IMPLEMENTATIONS[name](model, budget=6, **extra).layers[0].policy
    assert isinstance(policy, ScoredPolicy)
    cls = type(policy.scorer)
    original, calls = cls.before_selection, []

    def counted(self, host, view, real):
        calls.append(view.seen)
        original(self, host, view, real)

    monkeypatch.setattr(cls, "before_selection", counted)
    cache = CACHE_IMPLEMENTATIONS[name](model, budget=6, rescore_every=4, **extra)
    model.generate(random_ids(1, 10), max_new_tokens=9, do_sample=False, **cache_kwargs(cache))
    # 8 decode steps (the first new token comes from the prefill), all evicting: re-scored before steps 1 and 5
    assert len(calls) == 2 * len(cache.layers)
    assert sorted(set(calls)) == [10, 14]  # view.seen before the step's token: multiples of 4 past the budget
    with pytest.raises(ValueError, match="rescore_every"):
        CACHE_IMPLEMENTATIONS[name](model, budget=6, rescore_every=0, **extra)
