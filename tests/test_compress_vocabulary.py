"""One vocabulary for prompt eviction's budget (docs/vocabulary.md): `kv_compress`'s `budget` is what the prompt keeps,
as `generate`'s `budget=` (a share in (0, 1] or a number of tokens), and `recent` the newest tokens always kept. The
old spellings (a number as the share evicted, the key `ratio`, `window` for `recent`, `observation` for SnapKV's
`window`) keep their meaning until hf-kvcache 0.4, each with a FutureWarning saying what to write instead. A scorer's
own fields are spelled as the scorer and its cache spell them (SnapKV's observation `window`, as in SnapKVCache)."""

import warnings

import pytest

from hf_kvcache.paged.compress_spec import CompressSpec, parse

PROMPTS = (1, 2, 3, 7, 64, 100, 333, 1000, 1500, 4097)
# (old spelling, new spelling): the same spec
SAME = [
    ("keydiff:0.75", "keydiff:budget=0.25"),
    (0.75, "budget=0.25"),
    ("0.75", {"budget": 0.25}),
    ("knorm:0.5", {"method": "knorm", "budget": 0.5}),
    ({"method": "knorm", "ratio": 0.7}, "knorm:budget=0.3"),
    ("snapkv:0.9", "snapkv:budget=0.1"),
    ("keydiff:0.75:chunk=128", "keydiff:budget=0.25:chunk=128"),
    ("kvzap:0.5:window=8", "kvzap:budget=0.5:recent=8"),
    ({"method": "sink_window", "ratio": 0.5, "window": 16}, {"method": "sink_window", "budget": 0.5, "recent": 16}),
    ("keydiff:window=8", "keydiff:recent=8"),
    ({"method": "snapkv", "budget": 0.5, "observation": 16}, "snapkv:budget=0.5:window=16"),
    ("snapkv:0.5:observation=16:kernel=3", {"method": "snapkv", "budget": 0.5, "window": 16, "kernel": 3}),
]


def _new(value):
    """The spec of a new spelling: no warning at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return parse(value)


@pytest.mark.parametrize("old, new", SAME, ids=[str(old) for old, _ in SAME])
def test_old_spellings_mean_the_same_with_a_future_warning(old, new):
    with pytest.warns(FutureWarning, match=r"deprecated spelling, accepted until hf-kvcache 0\.4") as caught:
        before = parse(old)
    spec = _new(new)
    assert before == spec
    assert [before.kept(p) for p in PROMPTS] == [spec.kept(p) for p in PROMPTS]
    assert [before.peak(p) for p in PROMPTS] == [spec.peak(p) for p in PROMPTS]
    assert before.label() == spec.label()  # one name for one spec
    assert repr(spec.spelling()) in str(caught[0].message)  # the warning says what to write
    assert _new(spec.spelling()) == spec


def test_the_old_share_evicted_keeps_what_it_kept():
    """ceil(P x (1 - ratio)), at least 1, as before the rename, for every ratio the results used."""
    for ratio in (0.1, 0.25, 0.5, 0.7, 0.75, 0.9, 0.95):
        with pytest.warns(FutureWarning):
            spec = parse(f"keydiff:{ratio}")
        for p in PROMPTS:
            assert spec.kept(p) == max(1, min(p, -int(-(p * (1 - ratio) - 1e-9) // 1)))


def test_an_integer_budget_is_tokens_kept():
    spec = _new("keydiff:budget=256")
    assert spec.budget == 256 and [spec.kept(p) for p in (1, 255, 256, 257, 4000)] == [1, 255, 256, 256, 256]
    assert _new({"method": "knorm", "budget": 1}).kept(500) == 1  # the integer 1 is one token...
    assert _new({"method": "knorm", "budget": 1.0}) is None  # ...the share 1.0 the whole prompt: nothing evicted
    assert _new("keydiff:budget=1.0") is None and _new("keydiff:budget=64:chunk=32").peak(200) == 96
    assert spec.label() == spec.spelling() == "keydiff:budget=256"  # (no old spelling for a number of tokens)
    assert _new(spec.label()) == spec


def test_labels_are_unchanged():
    """GET /v1/kv_cache and the benchmarks' rows name a share-kept spec by its share evicted, as the committed
    results (eval/results/ruler_http, serve_bench.compress*) and docs/results.md do."""
    assert _new("keydiff:budget=0.25").label() == "keydiff:0.75"
    assert _new("kvzap:budget=0.25").label() == "kvzap:0.75"
    assert _new("keydiff:budget=0.25:chunk=128").label() == "keydiff:0.75:chunk=128"
    assert _new("snapkv:budget=0.3:recent=8").label() == "snapkv:0.7:recent=8"


def test_a_bare_method_keeps_the_default_budget():
    assert _new("keydiff") == _new("keydiff:budget=0.25") == CompressSpec(method="keydiff")
    assert _new("budget=0.25") == CompressSpec()  # no method named: the model's (eviction_checks.for_model)
    assert _new("knorm:chunk=64") == CompressSpec(method="knorm", chunk=64)


def test_the_dataclass_takes_the_old_keywords_with_a_warning():
    with pytest.warns(FutureWarning, match=r"`kv_compress.ratio` and `kv_compress.window`"):
        spec = CompressSpec(method="knorm", ratio=0.75, window=8)
    assert spec == CompressSpec(method="knorm", budget=0.25, recent=8)
    assert "ratio" not in spec.to_dict() and spec.to_dict()["budget"] == 0.25  # one thing stored: the budget kept


@pytest.mark.parametrize(
    "value, match",
    [
        ({"budget": 0.25, "ratio": 0.75}, r"`--kv-compress.budget` and `--kv-compress.ratio` are both given"),
        ("keydiff:0.75:budget=0.25", r"`--kv-compress.budget` and `--kv-compress.ratio` are both given"),
        ("keydiff:recent=4:window=4", r"`--kv-compress.recent` and `--kv-compress.window` are both given"),
        ("keydiff:budget=0", r"`--kv-compress.budget` \(what the prompt keeps\) .* got 0\."),
        ("keydiff:budget=1.5", r"`--kv-compress.budget` .* in \(0, 1\], got 1.5"),
        ("keydiff:budget=256.0", r"`--kv-compress.budget` .* got 256.0"),
        ({"budget": True}, r"`--kv-compress.budget` .* got True"),
        ("keydiff:budget=lots", r"`--kv-compress.budget` .* got 'lots'"),
        ("keydiff:1", r"`--kv-compress.ratio` \(the share of the prompt evicted\) must be a number in \[0, 1\)"),
        ({"ratio": 1.5}, r"`--kv-compress.ratio`"),
    ],
)
def test_errors_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        parse(value, "--kv-compress")


def test_a_scorers_own_fields_are_spelled_as_the_scorer_spells_them():
    """SnapKV's observation window is `window` here as in SnapKVCache and the composite (its scorer's field), while
    `window` stays the deprecated `recent` for methods whose scorer has none."""
    snapkv = _new("snapkv:budget=0.5:window=16:kernel=3")
    assert snapkv.options == {"window": 16, "kernel": 3} and snapkv.recent is None
    assert _new(snapkv.to_dict()) == snapkv and _new(snapkv.spelling()) == snapkv
    with pytest.raises(ValueError, match=r"`kv_compress.kernel` must be odd"):
        _new({"method": "snapkv", "budget": 0.5, "kernel": 4})
    with pytest.raises(ValueError, match=r"`kv_compress.window` and `kv_compress.observation` are both given"):
        parse({"method": "snapkv", "window": 8, "observation": 8})
    with pytest.raises(ValueError, match=r"`kv_compress.observation` .* method 'keydiff' has no observation window"):
        parse({"method": "keydiff", "observation": 8})
    with pytest.warns(FutureWarning, match="`kv_compress.window`"):
        assert parse("knorm:budget=0.5:window=8").recent == 8
