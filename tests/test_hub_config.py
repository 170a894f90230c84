"""Configs safe to publish on the Hub (hf_kvcache.sharing.hub): a local folder stands in for a Hub model repo; nothing
here touches the network (hf_hub_download and HfApi are patched where a repo id is used)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import build_model, planted_surrogate, random_ids
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import hf_kvcache
from hf_kvcache import (
    CompositeCache,
    H2OCache,
    KIVICache,
    KVCacheConfig,
    QuantizedFP8Cache,
    RandomEvictionCache,
    SinkCache,
    SlidingWindowCache,
    cache_kwargs,
    returned_cache,
)
from hf_kvcache.caches import registry
from hf_kvcache.caches.scorers import SCORER_CACHES, ScorerCache

SINK = {"sinks": 2, "window": 6}
NEW = 20


def saved_model(path, arch="llama", **overrides):
    model = build_model(arch, **overrides)
    model.save_pretrained(path)
    return model


def plain_transformers(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter that never imports hf_kvcache (checked at its end)."""
    code = textwrap.dedent(script) + textwrap.dedent("""
        import sys
        assert "hf_kvcache" not in sys.modules, "hf_kvcache was imported"
        print("HF_KVCACHE_ABSENT")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd="/"
    )


LOAD_AND_GENERATE = """
    import json, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained({path!r}).eval()
    ids = torch.tensor({ids})
    out = model.generate(ids, max_new_tokens={new}, do_sample=False, return_dict_in_generate=True)
    print("CACHE", type(next(v for k, v in out.items() if k in ("cache", "past_key_values"))).__name__)
    print("TOKENS", json.dumps(out.sequences.tolist()))
"""


def tokens_from(stdout: str) -> list:
    line = next(line for line in stdout.splitlines() if line.startswith("TOKENS "))
    return json.loads(line[len("TOKENS ") :])


# -- a published model loads everywhere, and uses our cache where hf_kvcache is imported -------------------------


def test_published_model_loads_and_generates_without_hf_kvcache(tmp_path):
    model = saved_model(tmp_path / "model")
    paths = hf_kvcache.publish(tmp_path / "model", "sink", SINK)
    assert set(paths) == {"kvcache_config.json", "generation_config.json"}
    generation = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    assert "cache_implementation" not in generation and "cache_config" not in generation
    assert generation["hf_kvcache"] == {
        "cache": "sink",
        "config": SINK,
        "version": 1,
        "hf_kvcache_version": hf_kvcache.__version__,
    }
    assert generation["bos_token_id"] == 1 and generation["pad_token_id"] == 0  # the model's own settings kept
    ids = random_ids(1, 12, seed=11)
    run = plain_transformers(LOAD_AND_GENERATE.format(path=str(tmp_path / "model"), ids=ids.tolist(), new=NEW))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HF_KVCACHE_ABSENT" in run.stdout
    assert "CACHE DynamicCache" in run.stdout  # transformers' default cache, the key ignored
    dense = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="dynamic")
    assert tokens_from(run.stdout) == dense.tolist()


def test_cache_implementation_with_our_name_breaks_plain_transformers(tmp_path):
    """Why the safe form exists: the old way of publishing makes from_pretrained fail without hf_kvcache."""
    model = build_model("llama")
    model.generation_config.cache_implementation = "sink"
    model.generation_config.cache_config = SINK
    model.save_pretrained(tmp_path / "unsafe")
    run = plain_transformers(LOAD_AND_GENERATE.format(path=str(tmp_path / "unsafe"), ids=[[5, 6, 7]], new=2))
    assert run.returncode != 0
    assert "Invalid `cache_implementation` (sink)" in run.stderr
    # publish() repairs such a folder: our name moves to the hf_kvcache key, with a warning that explains why
    with pytest.warns(UserWarning, match="refuses that name when hf_kvcache is not imported"):
        hf_kvcache.publish(tmp_path / "unsafe", "sink", SINK)
    run = plain_transformers(LOAD_AND_GENERATE.format(path=str(tmp_path / "unsafe"), ids=[[5, 6, 7]], new=2))
    assert run.returncode == 0, run.stderr[-3000:]


def test_generate_uses_the_published_cache(tmp_path):
    saved_model(tmp_path / "model")
    hf_kvcache.publish(tmp_path / "model", "sink", SINK)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert loaded.generation_config.hf_kvcache["cache"] == "sink"
    ids = random_ids(2, 12, seed=12)
    out = loaded.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    cache = returned_cache(out)
    assert type(cache) is SinkCache and (cache.sinks, cache.window) == (2, 6)
    direct = loaded.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="sink", cache_config=SINK)
    assert torch.equal(out.sequences, direct)
    dense = loaded.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="dynamic")
    assert not torch.equal(out.sequences, dense)  # the published cache really evicted
    # the same call twice: the published settings are not consumed
    again = loaded.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(again, direct)


def test_apply_to_a_models_generation_config_survives_save_pretrained(tmp_path):
    """A fresh model's generation config is marked `_from_model_config`, and transformers then drops unknown keys
    when loading it back: setting the attribute by hand is lost, KVCacheConfig.apply_to is not."""
    model = build_model("llama")
    model.generation_config.hf_kvcache = KVCacheConfig("sink", SINK).to_dict()
    model.save_pretrained(tmp_path / "by_hand")
    assert "hf_kvcache" in json.loads((tmp_path / "by_hand" / "generation_config.json").read_text())
    lost = AutoModelForCausalLM.from_pretrained(tmp_path / "by_hand")
    assert getattr(lost.generation_config, "hf_kvcache", None) is None  # transformers' behaviour, hence apply_to
    model = build_model("llama")
    model.generation_config.cache_implementation = "sink"  # the unsafe form is replaced
    KVCacheConfig("sink", SINK).apply_to(model.generation_config)
    assert model.generation_config.cache_implementation is None
    model.save_pretrained(tmp_path / "applied")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "applied").eval()
    assert KVCacheConfig.from_generation_config(loaded.generation_config) == KVCacheConfig("sink", SINK)
    out = loaded.generate(random_ids(1, 12), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert type(returned_cache(out)) is SinkCache and returned_cache(out).window == 6


@pytest.mark.parametrize(
    "name, cache_config, cls",
    [
        ("h2o", {"heavy": 3, "recent": 3}, H2OCache),
        ("sliding", {"window": 5}, SlidingWindowCache),
        ("composite", {"preset": "sinks_heavy_recent", "budget": 10}, CompositeCache),
        ("fp8", {"granularity": "head"}, QuantizedFP8Cache),
    ],
)
def test_generate_uses_each_published_cache(tmp_path, name, cache_config, cls):
    saved_model(tmp_path / "model", arch="qwen2")
    hf_kvcache.publish(tmp_path / "model", name, cache_config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = random_ids(1, 14, seed=13)
    out = loaded.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert type(returned_cache(out)) is cls
    direct = loaded.generate(
        ids, max_new_tokens=8, do_sample=False, cache_implementation=name, cache_config=cache_config
    )
    assert torch.equal(out.sequences, direct)


def test_caller_choice_wins_over_the_published_cache(tmp_path):
    saved_model(tmp_path / "model")
    hf_kvcache.publish(tmp_path / "model", "sink", SINK)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = random_ids(1, 12, seed=14)
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    dense = loaded.generate(ids, cache_implementation="dynamic", **kw)
    assert type(returned_cache(dense)) is DynamicCache
    sliding = loaded.generate(ids, cache_implementation="sliding", cache_config={"window": 5}, **kw)
    assert type(returned_cache(sliding)) is SlidingWindowCache and returned_cache(sliding).window == 5
    own = SinkCache(loaded, sinks=1, window=9)
    mine = loaded.generate(ids, **cache_kwargs(own), **kw)
    assert returned_cache(mine) is own
    ref = loaded.generate(
        ids, **cache_kwargs(SinkCache(loaded, sinks=1, window=9)), max_new_tokens=NEW, do_sample=False
    )
    assert torch.equal(mine.sequences, ref)
    # a caller's own GenerationConfig naming a cache wins too
    gen = GenerationConfig(cache_implementation="dynamic", max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, generation_config=gen), dense.sequences)
    # no cache at all: still generates, the same tokens as the dense cache
    no_cache = loaded.generate(ids, use_cache=False, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(no_cache, dense.sequences)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"cache": "static", "config": {}}, r"`cache` must be one of \[.*'sink'"),
        ({"cache": "sink", "config": {"windw": 8}}, r"valid keys are \[.*'window'"),
        ({"cache": "sink", "config": [4, 8]}, "`config` must be a JSON object"),
        ({"name": "sink"}, r"unknown field\(s\) \['name'\]"),
        ("sink", "must be a JSON object"),
        ({"cache": "sink", "version": 99}, "newer hf_kvcache"),
    ],
)
def test_malformed_generation_config_key_fails_clearly_at_generate(value, message):
    model = build_model("llama")
    model.generation_config.hf_kvcache = value
    with pytest.raises(ValueError, match=message) as err:
        model.generate(random_ids(1, 6), max_new_tokens=3, do_sample=False)
    assert "generation_config.json key 'hf_kvcache'" in str(err.value)
    # the caller can always bypass it
    out = model.generate(random_ids(1, 6), max_new_tokens=3, do_sample=False, cache_implementation="dynamic")
    assert out.shape == (1, 9)


# -- KVCacheConfig: files, dicts, errors ------------------------------------------------------------------------


def test_config_round_trip_and_build(tmp_path):
    cfg = KVCacheConfig("h2o", {"heavy": 4, "recent": 4, "aggregation": "mean"})
    path = cfg.save_pretrained(tmp_path / "cfg")
    assert path == str(tmp_path / "cfg" / "kvcache_config.json")
    on_disk = json.loads(open(path).read())
    assert on_disk == {
        "cache": "h2o",
        "config": {"heavy": 4, "recent": 4, "aggregation": "mean"},
        "version": 1,
        "hf_kvcache_version": hf_kvcache.__version__,
    }
    loaded = KVCacheConfig.from_pretrained(tmp_path / "cfg")
    assert loaded == cfg and loaded.to_dict() == cfg.to_dict() == on_disk
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert loaded.generate_kwargs() == {
        "cache_implementation": "h2o",
        "cache_config": {"heavy": 4, "recent": 4, "aggregation": "mean"},
    }
    model = build_model("llama")
    cache = loaded.build(model)
    assert type(cache) is H2OCache and (cache.heavy, cache.recent, cache.aggregation) == (4, 4, "mean")
    ids = random_ids(1, 12, seed=15)
    a = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(loaded.build(model)))
    b = model.generate(ids, max_new_tokens=10, do_sample=False, **loaded.generate_kwargs())
    assert torch.equal(a, b)


def test_config_is_a_private_json_copy():
    settings = {"regions": [{"role": "sinks", "tokens": 2}, {"role": "window", "start": 0, "end": 8}]}
    cfg = KVCacheConfig("composite", settings)
    settings["regions"][0]["tokens"] = 3
    assert cfg.config["regions"][0]["tokens"] == 2
    cfg.generate_kwargs()["cache_config"]["regions"].clear()
    assert len(cfg.config["regions"]) == 2


@pytest.mark.parametrize(
    "settings, where",
    [
        ({"sinks": torch.tensor(4), "window": 8}, "config['sinks']"),
        ({"sinks": 4, "window": float("nan")}, "config['window']"),
        ({"layers": {0: {"window": 4}}, "window": 8}, "config['layers']: key 0"),
        ({"sinks": 4, "window": 8, "position_mode": {"cache"}}, "config['position_mode']"),
    ],
)
def test_non_json_settings_refused(settings, where):
    with pytest.raises(ValueError) as err:
        KVCacheConfig("sink", settings)
    assert where in str(err.value)


def test_layers_settings_validated_without_the_model(tmp_path):
    # entries are checked against the cache's keys even though the minimal config has one layer
    KVCacheConfig("sink", {"window": 8, "layers": [None, {"window": 4}, "keep", {"cache": "fp8"}]})
    with pytest.raises(ValueError, match=r"config\['layers'\]\[1\].*valid keys are"):
        KVCacheConfig("sink", {"window": 8, "layers": [None, {"windw": 4}]})
    with pytest.raises(ValueError, match=r"config\['layers'\]\['full_attention'\]\['cache'\] must be one of"):
        KVCacheConfig("sink", {"window": 8, "layers": {"full_attention": {"cache": "static"}}})
    with pytest.raises(ValueError, match=r"must be null, \"default\", \"keep\" or a dict"):
        KVCacheConfig("sink", {"window": 8, "layers": [3]})
    # and against the real model when publishing: this model has 2 layers
    saved_model(tmp_path / "model")
    with pytest.raises(ValueError, match=r"one entry per decoder layer \(2\)"):
        hf_kvcache.publish(tmp_path / "model", "sink", {"window": 8, "layers": [None, None, None]})
    assert not (tmp_path / "model" / "kvcache_config.json").exists()


def test_calibrated_scales_load_without_the_model_and_are_checked_with_it(tmp_path):
    """FP8 scales describe one model's layers and heads: a file carrying them loads without the model (the minimal
    validation config has other shapes), and building for a model of another shape fails naming the mismatch."""
    from hf_kvcache.sharing.calibration import calibrate, save_calibrated_config

    model = build_model("llama")
    scales = calibrate(model, input_ids=random_ids(1, 16, seed=3), window=16)
    save_calibrated_config(tmp_path, model, scales)
    cfg = KVCacheConfig.from_pretrained(tmp_path)
    assert cfg.config["scales"] == scales
    assert type(cfg.build(model)) is QuantizedFP8Cache
    with pytest.raises(ValueError, match="num_layers=2, this model has 3"):
        cfg.build(build_model("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match="num_layers=2, this model has 3"):
        KVCacheConfig.from_pretrained(tmp_path, model_config=build_model("llama", num_hidden_layers=3).config)


BAD_FILES = [
    (b"", "is empty"),
    (b'{"cache": "sink", "config": {"sinks": 2, "win', "is truncated"),
    (b'{"cache": "sink", "config": {"sinks": 2}', "is truncated"),
    (b"cache: sink\nconfig:\n  sinks: 2\n", "is not valid JSON"),
    (b"\x80\x04\x95PK\x03\x04binary", "not UTF-8"),
    (b'["sink", {"sinks": 2}]', "must be a JSON object"),
    (b'{"cache": "sink", "config": {"sinks": NaN, "window": 8}}', "NaN is not valid JSON"),
    (b'{"cache": "sink", "cache": "h2o"}', "key 'cache' appears twice"),
    (b'{"config": {"sinks": 2}}', "missing field 'cache'"),
    (b'{"cache": "sink", "config": {}, "extra": 1}', r"unknown field\(s\) \['extra'\]"),
    (b'{"cache": "sinks", "config": {}}', r"`cache` must be one of \["),
    (b'{"cache": "sink", "config": {"sinks": -1, "window": 8}}', r"`sinks` must be an integer >= 0"),
    (b'{"cache": "sink", "config": {"sinks": 2, "windw": 8}}', r"valid keys are \["),
    (b'{"cache": "sink", "config": {}, "version": "1"}', r"`version` must be an integer >= 1"),
    (b'{"cache": "sink", "config": {}, "version": 2}', r"newer hf_kvcache"),
    (b'{"cache_implementation": "static", "cache_config": {}}', r"`cache` must be one of"),
]


@pytest.mark.parametrize("content, message", BAD_FILES)
def test_bad_config_files_name_the_file_and_the_problem(tmp_path, content, message):
    path = tmp_path / "kvcache_config.json"
    path.write_bytes(content)
    for load in (
        lambda: KVCacheConfig.from_pretrained(tmp_path),
        lambda: hf_kvcache.load_cache_config(tmp_path),
        lambda: KVCacheConfig.from_json_file(path),
    ):
        with pytest.raises(ValueError, match=message) as err:
            load()
        assert str(path) in str(err.value)


def test_bad_generation_config_key_in_a_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"hf_kvcache": {"cache": "sink", "config": 5}}))
    with pytest.raises(ValueError, match="generation_config.json key 'hf_kvcache': `config` must be a JSON object"):
        KVCacheConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"hf_kvcache": {"cache": "sink"')
    with pytest.raises(ValueError, match="generation_config.json is truncated"):
        KVCacheConfig.from_pretrained(tmp_path)


def test_missing_config_names_both_places(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither kvcache_config.json nor a 'hf_kvcache' key"):
        KVCacheConfig.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    with pytest.raises(FileNotFoundError, match="neither kvcache_config.json"):
        hf_kvcache.load_cache_config(tmp_path)


def test_folder_with_only_the_generation_config_key(tmp_path):
    saved_model(tmp_path / "model")
    hf_kvcache.publish(tmp_path / "model", "sliding", {"window": 9})
    os.remove(tmp_path / "model" / "kvcache_config.json")
    assert KVCacheConfig.from_pretrained(tmp_path / "model") == KVCacheConfig("sliding", {"window": 9})
    assert hf_kvcache.load_cache_config(tmp_path / "model") == {
        "cache_implementation": "sliding",
        "cache_config": {"window": 9},
    }


def test_publish_refuses_a_transformers_cache_name_and_missing_folder(tmp_path):
    model = build_model("llama")
    model.generation_config.cache_implementation = "static"
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"cache_implementation='static'.*instead of the published 'sink'"):
        hf_kvcache.publish(tmp_path / "model", "sink", SINK)
    assert not (tmp_path / "model" / "kvcache_config.json").exists()
    assert json.loads((tmp_path / "model" / "generation_config.json").read_text())["cache_implementation"] == "static"
    with pytest.raises(FileNotFoundError, match="not a folder"):
        hf_kvcache.publish(tmp_path / "nowhere", "sink", SINK)


def test_publish_creates_generation_config_from_the_model_config(tmp_path):
    saved_model(tmp_path / "model")
    os.remove(tmp_path / "model" / "generation_config.json")
    hf_kvcache.publish(tmp_path / "model", "sink", SINK)
    generation = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["pad_token_id"] == 0
    assert generation["hf_kvcache"]["config"] == SINK


# -- repo ids through huggingface_hub (patched: no network) ---------------------------------------------------------


def test_from_pretrained_repo_id_goes_through_hf_hub_download(tmp_path):
    KVCacheConfig("sink", SINK).save_pretrained(tmp_path / "snapshot")
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(tmp_path / "snapshot" / filename)

    with mock.patch("huggingface_hub.hf_hub_download", fake_download):
        cfg = KVCacheConfig.from_pretrained("someone/tiny-model", revision="v1.0", token="t", local_files_only=True)
    assert cfg == KVCacheConfig("sink", SINK)
    assert [(r, f) for r, f, _ in calls] == [("someone/tiny-model", "kvcache_config.json")]
    kwargs = calls[0][2]
    assert kwargs["revision"] == "v1.0" and kwargs["token"] == "t" and kwargs["local_files_only"] is True


def test_from_pretrained_repo_id_falls_back_to_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 5, "hf_kvcache": {"cache": "h2o", "config": {"budget": 16}, "version": 1}})
    )
    asked = []

    def fake_download(repo_id, filename, **kwargs):
        asked.append(filename)
        if filename == "kvcache_config.json":
            raise LocalEntryNotFoundError(f"{filename} not in {repo_id}")
        return str(tmp_path / filename)

    with mock.patch("huggingface_hub.hf_hub_download", fake_download):
        cfg = KVCacheConfig.from_pretrained("someone/tiny-model")
    assert asked == ["kvcache_config.json", "generation_config.json"]
    assert cfg == KVCacheConfig("h2o", {"budget": 16})

    def nothing(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError(f"{filename} not in {repo_id}")

    with mock.patch("huggingface_hub.hf_hub_download", nothing):
        with pytest.raises(FileNotFoundError, match=r"Hub repo 'someone/tiny-model' at revision 'main'"):
            KVCacheConfig.from_pretrained("someone/tiny-model", revision="main")


def test_publish_carries_a_kvzap_surrogate_in_the_model_folder(tmp_path):
    """A trained surrogate given to publish is copied into the model folder and referred to relative to the model:
    the folder alone (or its Hub repo) generates with it."""
    model = saved_model(tmp_path / "model")
    surrogate = planted_surrogate(model, seed=3)
    surrogate.save(tmp_path / "trained")
    hf_kvcache.publish(tmp_path / "model", "kvzap", {"budget": 8, "surrogate": str(tmp_path / "trained")})
    published = json.loads((tmp_path / "model" / "kvcache_config.json").read_text())
    assert published["config"]["surrogate"] == "model:kvzap_surrogate"
    assert sorted(os.listdir(tmp_path / "model" / "kvzap_surrogate")) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = random_ids(1, 30, seed=14)
    out = loaded.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = returned_cache(out)
    assert type(cache) is hf_kvcache.KVzapCache
    assert torch.equal(cache.surrogate.weights[1]["weight"], surrogate.weights[1]["weight"])
    direct = loaded.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="kvzap",
        cache_config={"budget": 8, "surrogate": surrogate},
    )
    assert torch.equal(out.sequences, direct)
    # a Surrogate object is saved the same way
    hf_kvcache.publish(tmp_path / "model", "kvzap", {"budget": 8, "surrogate": planted_surrogate(model, seed=4)})
    assert hf_kvcache.KVCacheConfig.from_pretrained(tmp_path / "model").config["surrogate"] == "model:kvzap_surrogate"


def test_a_surrogate_beside_a_hub_model_is_fetched_from_its_folder(tmp_path):
    model = build_model("llama")
    planted_surrogate(model, seed=5).save(tmp_path / "snapshot" / "kvzap_surrogate")
    calls = []

    def fake_snapshot(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    model.config._name_or_path, model.config._commit_hash = "someone/tiny-model", "abc123"
    with mock.patch("huggingface_hub.snapshot_download", fake_snapshot):
        cache = hf_kvcache.KVzapCache(model, budget=8, surrogate="model:kvzap_surrogate")
    assert calls[0][0] == "someone/tiny-model" and calls[0][1]["revision"] == "abc123"  # the model's own commit
    assert calls[0][1]["allow_patterns"] == ["kvzap_surrogate/config.json", "kvzap_surrogate/model.safetensors"]
    assert torch.equal(cache.surrogate.weights[0]["bias"], torch.zeros(model.config.num_key_value_heads))
    model.config._name_or_path = ""
    with pytest.raises(ValueError, match=r"`surrogate` 'model:kvzap_surrogate' is a folder of the model"):
        hf_kvcache.KVzapCache(model, budget=8, surrogate="model:kvzap_surrogate")
    with pytest.raises(ValueError, match=r"`subfolder` must be a relative folder"):
        hf_kvcache.scorers.kvzap_surrogate.Surrogate.load(tmp_path / "snapshot", subfolder="../x")


class _Repo:
    def __init__(self, repo_id):
        self.repo_id = repo_id


def test_push_to_hub_uploads_only_the_config(tmp_path):
    cfg = KVCacheConfig("composite", {"preset": "sinks_heavy_recent", "budget": 64, "precision": "full"})
    uploads = []

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploads.append(
            (repo_id, {f: open(os.path.join(folder_path, f)).read() for f in os.listdir(folder_path)}, kwargs)
        )
        return "commit-url"

    with (
        mock.patch("huggingface_hub.HfApi.create_repo", return_value=_Repo("me/model")) as create,
        mock.patch("huggingface_hub.HfApi.upload_folder", upload_folder),
        mock.patch("huggingface_hub.HfApi.create_branch") as branch,
    ):
        assert cfg.push_to_hub("me/model", private=True, commit_message="add cache") == "commit-url"
        assert create.call_args.args == ("me/model",) and create.call_args.kwargs["exist_ok"] is True
        assert create.call_args.kwargs["private"] is True
        branch.assert_not_called()
        cfg.save_pretrained(tmp_path / "model", push_to_hub=True, repo_id="me/model", revision="dev")
        assert branch.call_args.kwargs["branch"] == "dev"
    (repo, files, kwargs), (repo2, files2, kwargs2) = uploads
    assert repo == repo2 == "me/model"
    assert set(files) == set(files2) == {"kvcache_config.json"}  # never README.md or generation_config.json
    assert json.loads(files["kvcache_config.json"]) == cfg.to_dict()
    assert kwargs["commit_message"] == "add cache" and kwargs["allow_patterns"] == ["kvcache_config.json"]
    assert kwargs2["revision"] == "dev"
    assert json.loads((tmp_path / "model" / "kvcache_config.json").read_text()) == cfg.to_dict()


# -- defaults: every name runs without a cache_config --------------------------------------------------------------

EXPECTED_DEFAULTS = {
    "sink": (SinkCache, {"sinks": 4, "window": 1020}),
    "sliding": (SlidingWindowCache, {"window": 1024}),
    "h2o": (H2OCache, {"heavy": 0.1, "recent": 0.1}),
    "random_eviction": (RandomEvictionCache, {"heavy": 0.1, "recent": 0.1}),
    "composite": (CompositeCache, {"preset": "sinks_heavy_recent", "budget": 1024}),
    "fp8": (QuantizedFP8Cache, {"format": "fp8_e4m3", "granularity": "token", "residual": 0}),
    "kivi": (KIVICache, {"bits": 4, "group_size": 32, "residual": 128}),
    **{cls.cache_name: (cls, {"budget": 0.2}) for cls in SCORER_CACHES},
    "snapkv": (SCORER_CACHES[3], {"budget": 1024, "window": 64}),
    "kvzip": (hf_kvcache.KVzipCache, {"budget": 0.2, "sinks": 4, "chunk_size": 2048}),
    "kvzap": (hf_kvcache.KVzapCache, {"budget": 0.2, "sinks": 4}),
}


def test_defaults_table_covers_every_name():
    assert set(registry.DEFAULT_CACHE_CONFIGS) == set(hf_kvcache.CACHE_IMPLEMENTATIONS) == set(EXPECTED_DEFAULTS)
    sections = (Path(__file__).parent.parent / "docs" / "caches.md").read_text()
    for name, cls in hf_kvcache.CACHE_IMPLEMENTATIONS.items():
        if issubclass(cls, ScorerCache):  # a plain scorer cache: its section in docs/caches.md, from the registry
            assert f"## `{name}` — {cls.__name__}" in sections, name
        else:  # documented in the module docstring's table
            assert f"| `{name}` |" in registry.__doc__, name


@pytest.mark.parametrize("name", sorted(EXPECTED_DEFAULTS))
def test_every_name_runs_without_cache_config(name, tmp_path):
    model = build_model("llama")  # max_position_embeddings 1024
    if name == "kvzip":  # its request is tokenized with the model's own tokenizer, found by name_or_path
        from test_generation_modes import tiny_chat_tokenizer

        tiny_chat_tokenizer().save_pretrained(tmp_path)
        model.config._name_or_path = str(tmp_path)
    ids = random_ids(1, 30, seed=16)
    if name == "kvzap":  # a surrogate is shipped for SmolLM2 only: another model must be given one, by name
        with pytest.raises(ValueError, match="`surrogate`"):
            model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation=name)
        return
    out = model.generate(
        ids, max_new_tokens=6, do_sample=False, cache_implementation=name, return_dict_in_generate=True
    )
    cls, expected = EXPECTED_DEFAULTS[name]
    cache = returned_cache(out)
    assert type(cache) is cls and out.sequences.shape == (1, 36)
    assert {key: getattr(cache, key) for key in expected} == expected
    # the same as spelling the defaults out
    spelled = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation=name,
        cache_config=registry.DEFAULT_CACHE_CONFIGS[name],
    )
    assert torch.equal(out.sequences, spelled)


def test_h2o_default_is_a_20_percent_budget():
    model = build_model("llama")
    ids = random_ids(1, 40, seed=17)
    out = model.generate(
        ids, max_new_tokens=1, do_sample=False, cache_implementation="h2o", return_dict_in_generate=True
    )
    layer = returned_cache(out).compressed_layers[0]
    assert layer.get_seq_length() == 40
    kept = returned_cache(out).get_mask_sizes(torch.arange(1), 0)[0]
    assert kept <= 0.2 * 40 + 1  # heavy 4 + recent 4 of a 40-token prompt (+ the new token)


def test_defaults_follow_the_model_context():
    small = build_model("llama", max_position_embeddings=256)
    assert hf_kvcache.default_cache_config("sink", small) == {"sinks": 4, "window": 252}
    assert hf_kvcache.default_cache_config("sliding", small.config) == {"window": 256}
    assert hf_kvcache.default_cache_config("composite", small)["budget"] == 256
    assert hf_kvcache.default_cache_config("h2o", small) == {"heavy": 0.1, "recent": 0.1}
    assert hf_kvcache.default_cache_config("sink", build_model("llama")) == {"sinks": 4, "window": 1020}
    out = small.generate(
        random_ids(1, 10), max_new_tokens=3, do_sample=False, cache_implementation="sink", return_dict_in_generate=True
    )
    assert (returned_cache(out).sinks, returned_cache(out).window) == (4, 252)
    # KIVI's value groups must divide head_dim (16 here): they shrink to gcd(32, head_dim), key blocks stay 32
    assert hf_kvcache.default_cache_config("kivi", small) == {"value_group_size": 16}
    assert hf_kvcache.default_cache_config("kivi", build_model("llama", hidden_size=128)) == {}  # head_dim 32
    assert registry.resolve_cache_config("kivi", small, {"group_size": 16}) == {"group_size": 16}
    # the table itself is not modified by deriving from a model
    assert registry.DEFAULT_CACHE_CONFIGS["sink"] == {"sinks": 4, "window": 1020}


@pytest.mark.parametrize(
    "name, given, expected",
    [
        ("sink", {"budget": 64}, {"sinks": 4, "budget": 64}),
        ("sink", {"sinks": 1}, {"sinks": 1, "window": 1020}),
        ("sink", {"window": 10, "position_mode": "original"}, {"sinks": 4, "window": 10, "position_mode": "original"}),
        ("h2o", {"budget": 10}, {"budget": 10}),
        ("h2o", {"heavy": 0.2}, {"heavy": 0.2, "recent": 0.1}),
        (
            "composite",
            {"regions": [{"role": "window", "start": 0, "end": 8}]},
            {"regions": [{"role": "window", "start": 0, "end": 8}]},
        ),
        ("composite", {"budget": 32}, {"preset": "sinks_heavy_recent", "budget": 32}),
        ("fp8", {"format": "fp8_e5m2"}, {"format": "fp8_e5m2"}),
    ],
)
def test_caller_keys_merge_over_defaults(name, given, expected):
    model = build_model("llama")
    before = json.loads(json.dumps(given))
    assert registry.resolve_cache_config(name, model, given) == expected
    assert given == before  # not modified
    hf_kvcache.build_cache(name, model, given)  # and it builds


def test_unknown_key_still_lists_valid_keys_with_defaults():
    model = build_model("llama")
    with pytest.raises(
        ValueError, match=r"Unknown cache_config for cache_implementation='sliding' key\(s\) \['size'\]"
    ):
        model.generate(random_ids(1, 5), max_new_tokens=2, cache_implementation="sliding", cache_config={"size": 8})
