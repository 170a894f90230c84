"""Registration with transformers' generate: names, idempotence, built-ins untouched, published configs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import ARCHS, build_model, random_ids
from transformers import GenerationConfig
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

import hf_kvcache
from hf_kvcache import CACHE_ARG, SinkCache, SlidingWindowCache, cache_kwargs
from hf_kvcache.caches import registry
from hf_kvcache.integration import generation as upstream_generation

OURS = set(hf_kvcache.CACHE_IMPLEMENTATIONS)


def fresh_builtin_names() -> set[str]:
    """transformers' own names recomputed from the module's untouched component tuples, plus 'paged'."""
    cu = configuration_utils
    recomputed = (
        set(cu.STATIC_CACHE_IMPLEMENTATIONS)
        | set(cu.DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS)
        | set(cu.DYNAMIC_CACHE_IMPLEMENTATIONS)
    )
    return recomputed | {"paged"}


def test_cache_implementations_are_ours():
    assert set(hf_kvcache.CACHE_IMPLEMENTATIONS) >= {"sink", "sliding"}
    assert hf_kvcache.CACHE_IMPLEMENTATIONS["sink"] is SinkCache
    assert hf_kvcache.CACHE_IMPLEMENTATIONS["sliding"] is SlidingWindowCache
    for name, cls in hf_kvcache.CACHE_IMPLEMENTATIONS.items():
        assert cls.cache_name == name


def test_no_name_shadows_a_builtin():
    recorded = set(upstream_generation.builtin_cache_names())
    assert not OURS & recorded
    fresh = (set(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) - OURS) | {"paged"}
    assert not OURS & fresh
    assert not OURS & fresh_builtin_names()
    # the recorded built-ins are exactly transformers' own list
    assert recorded == fresh == fresh_builtin_names()
    assert {"static", "dynamic", "offloaded", "quantized", "sliding_window", "hybrid", "paged"} <= recorded
    # also never one of transformers' layer-type names
    assert not OURS & {"full_attention", "sliding_attention", "chunked_attention", "hybrid_chunked"}


def test_our_names_accepted_by_generation_config_validate():
    for name in OURS:
        GenerationConfig(cache_implementation=name).validate(strict=True)
    with pytest.raises(ValueError):
        GenerationConfig(cache_implementation="no_such_cache").validate(strict=True)


def test_register_is_idempotent():
    hf_kvcache.register()
    hf_kvcache.register()
    names = list(configuration_utils.ALL_CACHE_IMPLEMENTATIONS)
    assert len(names) == len(set(names))
    assert set(names) >= OURS
    wrapper = GenerationMixin._prepare_cache_for_generation
    assert wrapper is upstream_generation._prepare_cache_for_generation
    original = wrapper.original
    assert original is not wrapper
    assert not hasattr(original, "original")  # not wrapped twice
    assert original.__module__ == "transformers.generation.utils"
    # generate still works after repeated registration
    model = build_model("llama")
    ids = random_ids(1, 6)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=5, do_sample=False, cache_implementation="sink", cache_config={"sinks": 2, "window": 20}
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["dynamic", "static", "offloaded", "quantized"])
def test_builtin_caches_still_work(name):
    if name == "quantized" and not transformers.utils.is_optimum_quanto_available():
        pytest.skip("optimum-quanto not installed")
    if name == "offloaded" and not torch.cuda.is_available():
        pytest.skip("transformers' offloaded cache needs CUDA streams")
    model = build_model("llama")
    ids = random_ids(2, 8, seed=3)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation=name)
    assert out.shape == ref.shape
    if name != "quantized":
        assert torch.equal(out, ref)


def test_builtin_static_after_bridge_enabled():
    """A model switched to the bridge still runs transformers' own caches identically."""
    model = build_model("llama")
    ids = random_ids(2, 8, seed=4)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    hf_kvcache.enable(model)
    for name in ("static", "dynamic"):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation=name)
        assert torch.equal(out, ref), name


@pytest.mark.parametrize("version", ["4.57.0", "5.22.9", "5.25.0", "6.0.0", "6.1.0"])
def test_unsupported_transformers_version(version):
    # the declared range is the tested one (5.23, 5.24): tests/test_upstream_contracts.py checks the rest
    with pytest.raises(hf_kvcache.UnsupportedTransformersError, match=r">=5\.23,<5\.25"):
        registry.check_transformers_version(version)
    with pytest.raises(hf_kvcache.UnsupportedTransformersError, match=version.replace(".", r"\.")):
        registry.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.3", transformers.__version__])
def test_supported_transformers_version(version):
    registry.check_transformers_version(version)  # no error


def test_register_on_an_untested_version_warns_once_and_registers(monkeypatch):
    from hf_kvcache.integration import versions

    monkeypatch.setattr(transformers, "__version__", "4.57.0")
    monkeypatch.setattr(versions, "_warned", False)
    with pytest.warns(UserWarning, match=r"4\.57\.0.*>=5\.23,<5\.25"):
        hf_kvcache.register()  # every contract still holds here: registration proceeds
    assert set(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) >= OURS


def test_unknown_cache_config_key_lists_valid_keys():
    model = build_model("llama")
    ids = random_ids(1, 5)
    with pytest.raises(ValueError) as err:
        model.generate(ids, max_new_tokens=3, cache_implementation="sink", cache_config={"sink": 4, "window": 8})
    message = str(err.value)
    assert "sink" in message
    for key in ("sinks", "window", "budget", "position_mode"):
        assert key in message
    with pytest.raises(ValueError, match="window"):
        model.generate(ids, max_new_tokens=3, cache_implementation="sliding", cache_config={"windw": 8})
    with pytest.raises(ValueError, match="sinks"):
        hf_kvcache.build_cache("sink", model.config, {"sinkz": 1, "window": 4})


def test_cache_implementation_and_cache_object_conflict():
    model = build_model("llama")
    with pytest.raises(ValueError, match=f"`{CACHE_ARG}`"):
        model.generate(
            random_ids(1, 5),
            max_new_tokens=3,
            cache_implementation="sink",
            cache_config={"window": 8},
            **cache_kwargs(SinkCache(model, window=8)),
        )


def test_cache_config_not_consumed_by_generate():
    """generate may be called several times with the same cache_config dict: it must not be mutated."""
    model = build_model("llama")
    cfg = {"sinks": 2, "window": 6}
    ids = random_ids(1, 10)
    a = model.generate(ids, max_new_tokens=15, do_sample=False, cache_implementation="sink", cache_config=cfg)
    assert cfg == {"sinks": 2, "window": 6}
    b = model.generate(ids, max_new_tokens=15, do_sample=False, cache_implementation="sink", cache_config=cfg)
    assert torch.equal(a, b)


def test_generation_config_round_trip(tmp_path):
    model = build_model("llama")
    ids = random_ids(2, 12, seed=5)
    cache_config = {"sinks": 2, "window": 6, "position_mode": "cache"}
    direct = model.generate(
        ids, max_new_tokens=15, do_sample=False, cache_implementation="sink", cache_config=cache_config
    )
    gen = GenerationConfig(
        cache_implementation="sink", cache_config=cache_config, max_new_tokens=15, do_sample=False, pad_token_id=0
    )
    gen.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "generation_config.json").read_text())
    assert on_disk["cache_implementation"] == "sink" and on_disk["cache_config"] == cache_config
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation == "sink" and loaded.cache_config == cache_config
    out = model.generate(ids, generation_config=loaded)
    assert torch.equal(out, direct)
    full = model.generate(ids, max_new_tokens=15, do_sample=False)
    assert not torch.equal(out, full)  # the loaded config really evicted


def test_model_published_with_generation_config(tmp_path):
    """save_pretrained of a model whose generation_config names our cache; from_pretrained (local) uses it."""
    model = build_model("qwen2")
    ids = random_ids(1, 12, seed=6)
    cache_config = {"window": 7}
    direct = model.generate(
        ids, max_new_tokens=15, do_sample=False, cache_implementation="sliding", cache_config=cache_config
    )
    model.generation_config.cache_implementation = "sliding"
    model.generation_config.cache_config = cache_config
    model.generation_config.max_new_tokens = 15
    model.generation_config.do_sample = False
    model.save_pretrained(tmp_path)
    _, model_cls, _ = ARCHS["qwen2"]
    loaded = model_cls.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.cache_implementation == "sliding"
    out = loaded.generate(ids)
    assert torch.equal(out, direct)


def test_save_load_cache_config_round_trip(tmp_path):
    path = hf_kvcache.save_cache_config(tmp_path / "model", "sink", {"sinks": 4, "budget": 16})
    assert path.endswith("kvcache_config.json")
    data = json.loads(open(path).read())
    # the safe form (hf_kvcache.sharing.hub): never a `cache_implementation`, which transformers refuses without our
    # package
    assert data == {
        "cache": "sink",
        "config": {"sinks": 4, "budget": 16},
        "version": 1,
        "hf_kvcache_version": hf_kvcache.__version__,
    }
    assert "cache_implementation" not in open(path).read()
    loaded = hf_kvcache.load_cache_config(tmp_path / "model")
    assert loaded == {"cache_implementation": "sink", "cache_config": {"sinks": 4, "budget": 16}}
    model = build_model("llama")
    ids = random_ids(1, 10, seed=7)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, **loaded)
    direct = model.generate(
        ids, max_new_tokens=20, do_sample=False, cache_implementation="sink", cache_config={"sinks": 4, "budget": 16}
    )
    assert torch.equal(out, direct)
    cache = hf_kvcache.build_cache(loaded["cache_implementation"], model.config, loaded["cache_config"])
    assert isinstance(cache, SinkCache) and (cache.sinks, cache.window) == (4, 12)


def test_save_cache_config_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="budget"):
        hf_kvcache.save_cache_config(tmp_path, "sink", {"budgt": 16})
    with pytest.raises(ValueError, match="sliding"):
        hf_kvcache.save_cache_config(tmp_path, "no_such_cache", {})
    assert not (tmp_path / "kvcache_config.json").exists()


# Regression (found by this suite, fixed in the library): registry.save_cache_config promises to check that the config
# 'builds a valid cache description' but only checks key names: values that every model rejects (sinks >= budget,
# budget 0, ...) are written and only fail later, at load/generate time. ({"sinks": 4} without a window is valid
# since every name has defaults: registry.DEFAULT_CACHE_CONFIGS fills the window.)
@pytest.mark.parametrize(
    "cache_config",
    [
        {"sinks": 4, "budget": 2},
        {"sinks": 4, "budget": 0},
        {"sinks": 4, "window": 0},
        {"sinks": 4, "position_mode": "rope"},
    ],
)
def test_save_cache_config_rejects_invalid_values(tmp_path, cache_config):
    with pytest.raises(ValueError):
        hf_kvcache.save_cache_config(tmp_path, "sink", cache_config)
    assert not (tmp_path / "kvcache_config.json").exists()


def test_load_cache_config_reads_the_old_format(tmp_path):
    """Folders written by hf_kvcache 0.1 ({"cache_implementation": ..., "cache_config": ...}) still load."""
    (tmp_path / "kvcache_config.json").write_text(
        json.dumps({"cache_implementation": "sink", "cache_config": {"sinks": 2, "window": 6}})
    )
    assert hf_kvcache.load_cache_config(tmp_path) == {
        "cache_implementation": "sink",
        "cache_config": {"sinks": 2, "window": 6},
    }


def test_load_cache_config_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        hf_kvcache.load_cache_config(tmp_path)
    (tmp_path / "kvcache_config.json").write_text(json.dumps({"cache_implementation": "static", "cache_config": {}}))
    with pytest.raises(ValueError, match="static"):
        hf_kvcache.load_cache_config(tmp_path)
    (tmp_path / "kvcache_config.json").write_text(json.dumps({"cache_implementation": "sink", "extra": 1}))
    with pytest.raises(ValueError, match="extra"):
        hf_kvcache.load_cache_config(tmp_path)


def _unregister(name):
    """Take a test's name back out, through the `cache_names` patch (hf_kvcache.integration.patches), which then
    still holds transformers' own tuple as the original to restore."""
    from hf_kvcache.integration import patches

    hf_kvcache.CACHE_IMPLEMENTATIONS.pop(name, None)
    if name in upstream_generation._names:
        upstream_generation._names.remove(name)
    patches.install(patches.CACHE_NAMES)  # (recomputed from the original: the name is gone)
    assert name not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS


def test_register_custom_cache_class():
    class MySink(SinkCache):
        cache_name = "test_my_sink"

    try:
        hf_kvcache.register("test_my_sink", MySink)
        assert "test_my_sink" in configuration_utils.ALL_CACHE_IMPLEMENTATIONS
        model = build_model("llama")
        ids = random_ids(1, 8)
        out = model.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            cache_implementation="test_my_sink",
            cache_config={"sinks": 1, "window": 5},
        )
        ref = model.generate(
            ids, max_new_tokens=12, do_sample=False, cache_implementation="sink", cache_config={"sinks": 1, "window": 5}
        )
        assert torch.equal(out, ref)
        with pytest.raises(ValueError, match="KVCache"):
            hf_kvcache.register("test_bad", dict)
        assert "test_bad" not in hf_kvcache.CACHE_IMPLEMENTATIONS
    finally:
        _unregister("test_my_sink")
        _unregister("test_bad")


def test_register_refuses_builtin_name():
    before = dict(hf_kvcache.CACHE_IMPLEMENTATIONS)
    try:
        with pytest.raises(RuntimeError, match="static"):
            hf_kvcache.register("static", SinkCache)
    finally:
        hf_kvcache.CACHE_IMPLEMENTATIONS.clear()
        hf_kvcache.CACHE_IMPLEMENTATIONS.update(before)


# Regression (found by this suite, fixed in the library): registry.register stores CACHE_IMPLEMENTATIONS[name] = cls
# before the clash check: a refused built-in name stays registered, every later register() raises, and
# generate(cache_implementation='static') is routed to the refused class
def test_register_refusal_leaves_no_side_effects():
    """A clashing name is refused, and the refusal must leave the registry and generate as they were."""
    before = dict(hf_kvcache.CACHE_IMPLEMENTATIONS)
    try:
        with pytest.raises(RuntimeError, match="static"):
            hf_kvcache.register("static", SinkCache)
        polluted = dict(hf_kvcache.CACHE_IMPLEMENTATIONS)
        hf_kvcache.register()  # must still work
        model = build_model("llama")
        ids = random_ids(1, 6)
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
        assert torch.equal(out, ref)
    finally:
        hf_kvcache.CACHE_IMPLEMENTATIONS.clear()
        hf_kvcache.CACHE_IMPLEMENTATIONS.update(before)
    assert polluted == before
