"""`hf-kvcache export-hub` / hf_kvcache.sharing.export: a custom_generate folder that transformers 5.x runs offline with
`model.generate(custom_generate=folder, trust_remote_code=True)`, equal to generate with the same cache built
directly."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import runpy
import sys

import pytest
import torch
import yaml
from conftest import build_model, random_ids
from packaging.requirements import Requirement

from hf_kvcache import (
    CompositeCache,
    H2OCache,
    KIVICache,
    QuantizedFP8Cache,
    RandomEvictionCache,
    SinkCache,
    SlidingWindowCache,
    cache_kwargs,
    returned_cache,
)
from hf_kvcache.cli import main
from hf_kvcache.sharing.export import FILES, export_custom_generate, render_files

REGIONS = [
    {"role": "sinks", "tokens": 2},
    {"role": "window", "start": 0, "end": 4, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
    {"role": "heavy", "tokens": 4},
]

# name -> (settings baked into the folder, the same cache built directly from its class)
FAMILIES = {
    "sink": ({"sinks": 2, "window": 6}, lambda m: SinkCache(m, sinks=2, window=6)),
    "sliding": ({"window": 8}, lambda m: SlidingWindowCache(m, window=8)),
    "h2o": ({"heavy": 4, "recent": 4}, lambda m: H2OCache(m, heavy=4, recent=4)),
    "composite": ({"regions": REGIONS}, lambda m: CompositeCache(m, regions=REGIONS)),
    "fp8": ({"granularity": "head"}, lambda m: QuantizedFP8Cache(m, granularity="head")),
    "kivi": ({"bits": 4, "group_size": 16, "residual": 8}, lambda m: KIVICache(m, bits=4, group_size=16, residual=8)),
    "random_eviction": (
        {"heavy": 4, "recent": 4, "seed": 3},
        lambda m: RandomEvictionCache(m, heavy=4, recent=4, seed=3),
    ),
}

PROMPT = 16  # longer than every eviction budget above, so the caches evict during prefill and decode


def _generate(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_custom_generate_equals_the_cache_built_directly(tmp_path, name):
    settings, direct = FAMILIES[name]
    folder = tmp_path / f"export_{name}"
    model = build_model()
    export_custom_generate(folder, name, settings, model_config=model.config)
    ids = random_ids(2, PROMPT, seed=1)
    out = _generate(model, ids, custom_generate=str(folder), trust_remote_code=True)
    reference_cache = direct(model)
    reference = _generate(model, ids, **cache_kwargs(reference_cache))
    assert out.sequences.shape == (2, PROMPT + 5)
    assert torch.equal(out.sequences, reference.sequences)
    # the folder's cache is the named class with the baked-in settings, holding what the direct one holds
    assert type(returned_cache(out)) is type(reference_cache)
    assert returned_cache(out).nbytes() == reference_cache.nbytes()
    if name in ("sink", "sliding", "h2o", "random_eviction"):
        assert returned_cache(out).get_seq_length() < PROMPT + 5  # it evicted


def test_caller_overrides_cache_config_cache_object_and_cache_implementation(tmp_path):
    folder = tmp_path / "export_override"
    export_custom_generate(folder, "sink", {"sinks": 2, "window": 6})
    model = build_model()
    ids = random_ids(1, PROMPT, seed=2)
    kw = dict(custom_generate=str(folder), trust_remote_code=True)
    # cache_config replaces the baked-in settings
    out = _generate(model, ids, cache_config={"sinks": 1, "window": 3}, **kw)
    ref = _generate(model, ids, **cache_kwargs(SinkCache(model, sinks=1, window=3)))
    assert (returned_cache(out).sinks, returned_cache(out).window) == (1, 3)
    assert torch.equal(out.sequences, ref.sequences)
    # the caller's own cache object is the one used
    mine = SlidingWindowCache(model, window=5)
    out = _generate(model, ids, **cache_kwargs(mine), **kw)
    assert returned_cache(out) is mine
    again = _generate(model, ids, **cache_kwargs(SlidingWindowCache(model, window=5)))
    assert torch.equal(out.sequences, again.sequences)
    # a cache_implementation (with its cache_config) wins over the folder's cache
    out = _generate(model, ids, cache_implementation="sliding", cache_config={"window": 5}, **kw)
    assert type(returned_cache(out)) is SlidingWindowCache and returned_cache(out).window == 5
    # an invalid override names the field
    with pytest.raises(ValueError, match="window"):
        _generate(model, ids, cache_config={"sinks": 2, "window": 0}, **kw)
    with pytest.raises(ValueError, match=r"cache_config.*your own `cache`"):  # the template takes both names
        _generate(model, ids, cache_config={"window": 4}, **cache_kwargs(SinkCache(model, window=4)), **kw)


def test_model_repo_carrying_custom_generate_uses_the_cache_after_from_pretrained(tmp_path):
    """Copied into a model folder, transformers binds the function as model.generate at from_pretrained."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model_with_cache"
    model = build_model()
    model.save_pretrained(folder)
    export_custom_generate(folder, "sink", {"sinks": 2, "window": 6})
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert loaded.generate is not type(loaded).generate
    ids = random_ids(1, PROMPT, seed=3)
    out = loaded.generate(ids, max_new_tokens=5, return_dict_in_generate=True)  # input ids positionally
    ref = _generate(model, ids, **cache_kwargs(SinkCache(model, sinks=2, window=6)))
    assert type(returned_cache(out)) is SinkCache
    assert torch.equal(out.sequences, ref.sequences)


def test_folder_contents(tmp_path):
    written = export_custom_generate(tmp_path / "x", "composite", {"regions": REGIONS})
    assert sorted(written) == sorted(FILES)
    for rel, path in written.items():
        assert os.path.isfile(path) and path == str((tmp_path / "x" / rel).resolve())
    source = open(written[os.path.join("custom_generate", "generate.py")], encoding="utf-8").read()
    tree = ast.parse(source)
    # the settings are a string constant parsed with json, never code
    constants = {node.targets[0].id: node.value for node in tree.body if isinstance(node, ast.Assign)}
    assert isinstance(constants["CACHE_CONFIG_JSON"], ast.Constant)
    assert json.loads(constants["CACHE_CONFIG_JSON"].value) == {"regions": REGIONS}
    assert constants["CACHE_NAME"].value == "composite"
    assert "json.loads(CACHE_CONFIG_JSON)" in source
    # requirements: hf-kvcache and transformers ranges that the installed versions satisfy
    lines = open(written[os.path.join("custom_generate", "requirements.txt")]).read().split()
    reqs = {Requirement(line).name: Requirement(line) for line in lines}
    assert set(reqs) == {"hf-kvcache", "transformers"}
    for pkg, req in reqs.items():
        assert len(req.specifier) == 2  # a lower and an upper bound
        assert req.specifier.contains(importlib.metadata.version(pkg))
    assert not reqs["transformers"].specifier.contains("6.0.0")
    # README: YAML header with the custom_generate tag, and the usage
    readme = open(written["README.md"], encoding="utf-8").read()
    assert readme.startswith("---\n")
    header = yaml.safe_load(readme.split("---\n")[1])
    assert "custom_generate" in header["tags"]
    assert "custom_generate=" in readme and "trust_remote_code=True" in readme and '"regions"' in readme


def test_missing_package_raises_a_clear_import_error(tmp_path, monkeypatch):
    written = export_custom_generate(tmp_path / "x", "sliding", {"window": 8})
    monkeypatch.setitem(sys.modules, "hf_kvcache", None)  # `import hf_kvcache` now fails
    with pytest.raises(ImportError, match=r"pip install 'hf-kvcache>="):
        runpy.run_path(written[os.path.join("custom_generate", "generate.py")])


def test_cli_writes_the_same_folder(tmp_path, capsys):
    settings = {"sinks": 2, "window": 6}
    assert main(["export-hub", str(tmp_path / "cli"), "--cache", "sink:sinks=2,window=6"]) == 0
    export_custom_generate(tmp_path / "api", "sink", settings)
    for rel in FILES:
        assert (tmp_path / "cli" / rel).read_text() == (tmp_path / "api" / rel).read_text()
    assert "custom_generate=" in capsys.readouterr().out
    # the JSON form of --cache gives the same files too
    assert main(["export-hub", str(tmp_path / "json"), "--cache", 'sink:{"sinks": 2, "window": 6}']) == 0
    assert (tmp_path / "json" / FILES[0]).read_text() == (tmp_path / "api" / FILES[0]).read_text()


@pytest.mark.parametrize(
    "spec, field",
    [
        ("nonsense:window=4", "nonsense"),
        ("sink:windw=4", "windw"),
        ("sink:window=0", "window"),
        ("h2o:heavy=-1,recent=4", "heavy"),
        ("fp8:format=fp9", "format"),
        ("composite:regions=3", "regions"),
    ],
)
def test_bad_cache_errors_name_the_field(tmp_path, capsys, spec, field):
    name, _, rest = spec.partition(":")
    settings = {k: json.loads(v) if v[0] in "-0123456789" else v for k, v in (p.split("=") for p in rest.split(","))}
    with pytest.raises(ValueError, match=field):
        export_custom_generate(tmp_path / "api", name, settings)
    assert not (tmp_path / "api").exists()  # nothing written
    assert main(["export-hub", str(tmp_path / "cli"), "--cache", spec]) == 2
    err = capsys.readouterr().err
    assert "export-hub: error: --cache" in err and field in err
    assert not (tmp_path / "cli").exists()


def test_existing_files_are_kept_unless_overwrite(tmp_path, capsys):
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "README.md").write_text("my model card\n")
    with pytest.raises(ValueError, match="README.md.*overwrite"):
        export_custom_generate(folder, "sliding", {"window": 8})
    assert (folder / "README.md").read_text() == "my model card\n"
    assert not (folder / "custom_generate").exists()
    assert main(["export-hub", str(folder), "--cache", "sliding:window=8"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export-hub", str(folder), "--cache", "sliding:window=8", "--overwrite"]) == 0
    assert (folder / "README.md").read_text() == render_files("sliding", {"window": 8})["README.md"]
    with pytest.raises(ValueError, match="not a folder"):
        export_custom_generate(folder / "README.md", "sliding", {"window": 8})


def test_settings_tied_to_the_model_are_checked_against_model_config(tmp_path, capsys):
    """kivi group_size 16 does not fit the minimal validation config (head_dim 8) but fits the tiny model (16)."""
    with pytest.raises(ValueError, match="group_size"):
        export_custom_generate(tmp_path / "x", "kivi", {"group_size": 16})
    model = build_model()
    model.save_pretrained(tmp_path / "model")
    assert main(["export-hub", str(tmp_path / "cli"), "--cache", "kivi:group_size=16"]) == 2
    assert "group_size" in capsys.readouterr().err
    assert (
        main(["export-hub", str(tmp_path / "cli"), "--cache", "kivi:group_size=16", "--model", str(tmp_path / "model")])
        == 0
    )
    export_custom_generate(tmp_path / "api", "kivi", {"group_size": 16}, model_config=model.config)
    for rel in FILES:
        assert (tmp_path / "cli" / rel).read_text() == (tmp_path / "api" / rel).read_text()
    assert main(["export-hub", str(tmp_path / "y"), "--cache", "sink", "--model", str(tmp_path / "nothing")]) == 2
    assert "--model" in capsys.readouterr().err
