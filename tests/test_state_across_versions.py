"""A cache state file written on one supported transformers version loads and resumes on the other (hybrid model:
transformers' own sliding-window layer beside ours). The files in tests/data/state_across_versions were written
on each supported minor by its make_fixtures.py (before the package moved to packages by role, so they also check
that files of the current format written by the flat layout keep loading: hf_kvcache.sharing.state maps the moved
modules); this test runs on both ends of the range (marked `upstream`).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from conftest import build_model
from test_state import _continue, _prefix

import hf_kvcache
from hf_kvcache.integration.versions import TESTED_MINORS

pytestmark = pytest.mark.upstream

HERE = pathlib.Path(__file__).parent / "data" / "state_across_versions"
CASES = {
    "h2o": lambda m: hf_kvcache.H2OCache(m, heavy=4, recent=4, attention_score="accumulated"),  # (as written)
    "composite": lambda m: hf_kvcache.CompositeCache(m, preset="sinks_heavy_recent", budget=12),
    "sink": lambda m: hf_kvcache.SinkCache(m, sinks=2, window=6),
}


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def fixture_model():
    """The tiny hybrid model of the fixtures, saved once (model/) so that every version loads the same weights."""
    folder = HERE / "model"
    if not (folder / "config.json").exists():
        build_model(
            "qwen2", use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
        ).save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return model


@pytest.mark.parametrize("writer", TESTED_MINORS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_state_file_of_each_supported_version_resumes_here(name, writer):
    path = HERE / f"state-{name}-{writer}.safetensors"
    assert path.exists(), f"{path.name} missing: run make_fixtures.py with transformers {writer}"
    header = hf_kvcache.read_cache_state_header(path)
    model = fixture_model()
    resumed = hf_kvcache.load_cache_state(path, model)
    assert type(resumed.layers[0]).__name__ == "DynamicSlidingWindowLayer"  # transformers' layer, restored
    assert not hasattr(resumed.layers[0], "dtype") or resumed.layers[0].dtype == resumed.layers[0].keys.dtype
    # the same stream on this version, uninterrupted: the resumed cache continues it
    reference_model = fixture_model()
    uninterrupted = CASES[name](reference_model)
    token, mask = _prefix(reference_model, uninterrupted)
    assert resumed.get_seq_length() == uninterrupted.get_seq_length() and header["cache"] == type(resumed).cache_name
    expected = _continue(reference_model, uninterrupted, token, mask)
    hf_kvcache.enable(model)
    got = _continue(model, resumed, token, mask)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_file_does_not_depend_on_the_transformers_version(name):
    """What a transformers layer derives from its tensors (`dtype`, set by 5.23 and not by 5.24) is not saved: the
    same stream gives the same bytes on every supported version."""
    files = [(HERE / f"state-{name}-{writer}.safetensors").read_bytes() for writer in TESTED_MINORS]
    assert all(data == files[0] for data in files[1:])
