"""QuantSpec and cache-argument validation: every bad value is a clear error naming the field and what is allowed."""

from __future__ import annotations

import json

import pytest
from conftest import build_config
from transformers import GenerationConfig

import hf_kvcache.stores.quantization as quantization
from hf_kvcache import KIVICache, QuantizedFP8Cache
from hf_kvcache.stores.quantization import QuantSpec
from hf_kvcache.stores.regions import store_for_precisions


def test_defaults_and_json_round_trip():
    spec = QuantSpec()
    assert spec.to_dict() == {
        "format": "fp8_e4m3",
        "granularity": "token",
        "group_size": None,
        "backend": "torch",
        "scale_dtype": None,
    }
    for s in (
        QuantSpec("fp8_e5m2", "head"),
        QuantSpec("int8", "token", 16),
        QuantSpec("int4", "channel", 32, "quanto", "float16"),
        QuantSpec("int2", "token", 32, "hqq"),
        QuantSpec("fp8_e4m3", "token", 32, scale_dtype="e8m0"),
    ):
        assert QuantSpec.from_value(json.loads(json.dumps(s.to_dict()))) == s
    assert QuantSpec("int4", "channel").group_size == quantization.DEFAULT_CHANNEL_GROUP
    assert QuantSpec.from_value("full").format == "none"
    assert QuantSpec.from_value("int4").backend in ("quanto", "hqq")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"format": "fp9"}, r"`format` must be one of .*fp8_e4m3.*got 'fp9'"),
        ({"granularity": "row"}, r"`granularity` must be one of .*'tensor', 'head', 'token', 'channel'.*got 'row'"),
        ({"backend": "bitsandbytes"}, r"`backend` must be one of .*got 'bitsandbytes'"),
        ({"format": "int4", "backend": "torch"}, r"backend 'torch' does not support format 'int4'.*quanto' or 'hqq'"),
        ({"format": "int2", "backend": "torch"}, r"backend 'torch' does not support format 'int2'"),
        ({"format": "fp8_e4m3", "backend": "quanto"}, r"backend 'quanto' does not support format 'fp8_e4m3'.*'torch'"),
        ({"format": "int8", "granularity": "head"}, r"`granularity` for integer format 'int8' must be one of"),
        ({"format": "fp8_e4m3", "granularity": "head", "group_size": 16}, r"`group_size` must be None"),
        ({"group_size": 0}, r"`group_size` must be an integer >= 1"),
        ({"group_size": 2.5}, r"`group_size` must be an integer >= 1"),
        ({"format": "int8", "scale_dtype": "e8m0"}, r"`scale_dtype` must be one of"),
        ({"format": "fp8_e4m3", "granularity": "tensor", "scale_dtype": "float16"}, r"keeps float32 scales"),
    ],
)
def test_bad_specs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(**kwargs)


def test_unknown_spec_key():
    with pytest.raises(ValueError, match=r"Unknown .* key\(s\) \['bits'\]"):
        QuantSpec.from_value({"format": "int4", "bits": 4})


@pytest.mark.parametrize("backend, package", [("quanto", "optimum-quanto"), ("hqq", "hqq")])
def test_backend_package_missing(monkeypatch, backend, package):
    monkeypatch.setattr(quantization, "backend_available", lambda name: name == "torch")
    with pytest.raises(ImportError, match=rf"needs the `{package}` package.*pip install {package}"):
        QuantSpec("int4", backend=backend)
    with pytest.raises(ImportError, match=r"int4.*needs a packing backend: pip install optimum-quanto"):
        QuantSpec("int4")
    # torch formats need no package
    assert QuantSpec("int8").backend == "torch"


def test_group_size_must_divide_head_dim():
    config = build_config("llama")  # head_dim 16
    with pytest.raises(ValueError, match=r"`group_size` \(12\) must divide the model's head_dim \(16\)"):
        QuantizedFP8Cache(config, group_size=12)
    with pytest.raises(ValueError, match=r"`group_size` \(12\) must divide"):
        KIVICache(config, group_size=12)
    QuantizedFP8Cache(config, group_size=8)  # fine


def test_cache_argument_errors():
    config = build_config("llama")
    with pytest.raises(ValueError, match=r"`bits` must be one of \(2, 4, 8\), got 3"):
        KIVICache(config, bits=3)
    with pytest.raises(ValueError, match=r"`format` must be one of"):
        QuantizedFP8Cache(config, format="fp4")
    with pytest.raises(ValueError, match=r"`granularity` must be one of"):
        QuantizedFP8Cache(config, granularity="block")
    with pytest.raises(ValueError, match=r"`residual` must be an integer >= 0"):
        QuantizedFP8Cache(config, residual=-1)
    with pytest.raises(ValueError, match=r"`key_smoothing` must be a bool"):
        QuantizedFP8Cache(config, key_smoothing="yes")
    with pytest.raises(ValueError, match=r"Unknown `key` spec key\(s\) \['bits'\]"):
        QuantizedFP8Cache(config, key={"bits": 8})
    with pytest.raises(ValueError, match=r"Unknown cache_config .* key\(s\) \['bitz'\]"):
        QuantizedFP8Cache.from_cache_config(config, {"bitz": 4})
    with pytest.raises(ValueError, match=r"`scales` was given but nothing uses it"):
        QuantizedFP8Cache(config, scales={"format": "fp8_e4m3", "key_scale": [[1.0, 1.0]] * 2})


def test_cache_config_is_json_and_generation_config_round_trip(tmp_path):
    config = build_config("llama")
    cache_config = {
        "format": "fp8_e4m3",
        "granularity": "token",
        "group_size": 8,
        "key": {"format": "int8"},
        "value": {"format": "fp8_e5m2", "scale_dtype": "e8m0"},
        "residual": 4,
        "key_smoothing": True,
    }
    generation = GenerationConfig(cache_implementation="fp8", cache_config=cache_config)
    generation.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation == "fp8" and loaded.cache_config == cache_config
    cache = QuantizedFP8Cache.from_cache_config(config, loaded.cache_config)
    store = cache.layers[0].store
    assert store.key_spec == QuantSpec("int8", "token", 8)  # the shorthand group_size applies
    assert store.value_spec == QuantSpec("fp8_e5m2", "token", 8, scale_dtype="e8m0")
    assert store.residual == 4 and store.key_smoothing
    kivi = GenerationConfig(cache_implementation="kivi", cache_config={"bits": 2, "group_size": 8, "residual": 16})
    kivi.validate()
    cache = KIVICache.from_cache_config(config, kivi.cache_config)
    assert cache.layers[1].store.key_spec.granularity == "channel"
    assert cache.layers[1].store.value_spec.granularity == "token"


def test_region_store_rejects_channel_granularity():
    with pytest.raises(ValueError, match=r"regions\[1\]\.keys: granularity 'channel' needs the append-only"):
        store_for_precisions({"format": "int4", "granularity": "channel"}, "fp8_e4m3", "regions[1]")
    store = store_for_precisions("fp8_e4m3", "full", "regions[0]")
    assert store.key_spec.format == "fp8_e4m3" and store.value_spec.format == "none" and not store.append_only
