"""The transformers boundary (hf_kvcache.integration): every contract holds on the installed transformers, a broken
one makes the feature that needs it raise (never a silent fallback), no module outside the boundary imports a
private transformers module, and our own calls raise no deprecation warning.

Marked `upstream`: `make test-oldest` (CI, the oldest supported transformers) and `make test-latest` (the canary,
the newest release) run these with the smoke tests of tests/test_upstream_smoke.py.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
import transformers
from conftest import build_model, random_ids
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_kvcache
from hf_kvcache.integration import cache_argument, contracts, generation, versions
from hf_kvcache.integration.continuous_batching import QUANTIZED_PAGES
from hf_kvcache.integration.contracts import CONTRACTS, broken

pytestmark = pytest.mark.upstream

PACKAGE = pathlib.Path(hf_kvcache.__file__).parent
CONTRACTS_DOC = PACKAGE.parent / "docs" / "upstream_contracts.md"
#: transformers modules the rest of the library may import from (the public API: hf_kvcache.integration's docstring)
PUBLIC_MODULES = {"transformers", "transformers.utils"}
PUBLIC_FROM_UTILS = {"PushToHubMixin"}


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contract_holds_on_the_installed_transformers(name):
    problem = contracts.problem(name)
    assert problem is None, f"{contracts.error_for(name)}"


def test_the_cache_argument_name_is_read_from_the_signature():
    expected = "cache" if versions.installed() >= versions.Version("5.24.0") else "past_key_values"
    assert expected == hf_kvcache.CACHE_ARG
    assert cache_argument.FORWARD_NAMES[0] == expected and "past_key_values" in cache_argument.FORWARD_NAMES
    assert hf_kvcache.cache_kwargs("x") == {expected: "x"}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, tuple(alias.name for alias in node.names)


def test_no_module_outside_the_boundary_imports_a_private_transformers_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "integration" in path.relative_to(PACKAGE).parts:
            continue
        for line, module, names in _imports(path):
            if module != "transformers" and not module.startswith("transformers."):
                continue
            if module not in PUBLIC_MODULES or (module == "transformers.utils" and set(names) - PUBLIC_FROM_UTILS):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} {list(names)}")
    assert not offenders, "import it through hf_kvcache.integration instead:\n" + "\n".join(offenders)


def test_contract_listing_in_the_docs_is_current():
    """docs/upstream_contracts.md lists every internal relied on, generated from the registry (cannot drift)."""
    table = contracts.markdown_table()
    assert table in CONTRACTS_DOC.read_text(encoding="utf-8"), (
        f"regenerate the table in {CONTRACTS_DOC} (python scripts/upstream_contracts_table.py):\n{table}"
    )


# -- a broken contract raises where the feature is used ---------------------------------------------------------


def test_a_broken_contract_names_the_version_the_range_and_what_changed():
    with broken(generation.PREPARE, "it takes (self, config) now"):
        with pytest.raises(hf_kvcache.UnsupportedTransformersError) as error:
            hf_kvcache.register()
    message = str(error.value)
    assert transformers.__version__ in message and versions.SUPPORTED_RANGE_TEXT in message
    assert "it takes (self, config) now" in message and generation.PREPARE in message
    hf_kvcache.register()  # holds again: registration is idempotent and works


def test_broken_bridge_contract_refuses_to_enable_the_bridge():
    model = build_model("llama")
    with broken("decoder attention forward (cache.update)"):
        with pytest.raises(hf_kvcache.UnsupportedTransformersError, match="cache.update"):
            model.generate(
                random_ids(1, 6),
                max_new_tokens=2,
                do_sample=False,
                cache_implementation="sink",
                cache_config={"sinks": 1, "window": 4},
            )
    assert not hf_kvcache.attention.is_enabled(model)


def test_broken_cache_argument_contract_raises_on_use():
    with broken("GenerationMixin.prepare_inputs_for_generation (cache argument)"):
        with pytest.raises(hf_kvcache.UnsupportedTransformersError, match="`cache` .* `past_key_values`"):
            hf_kvcache.cache_kwargs(None)


@pytest.mark.parametrize("name", QUANTIZED_PAGES)
def test_quantized_pages_on_a_broken_contract_raise_instead_of_model_dtype_pages(monkeypatch, name):
    from hf_kvcache.integration import continuous_batching
    from hf_kvcache.paged import cache as paged_cache

    monkeypatch.setattr(
        continuous_batching.continuous_api, "PagedAttentionCache", continuous_batching.PagedAttentionCache
    )  # as if `import hf_kvcache` had not installed it
    model = build_model("llama")
    cb = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=64, allow_block_sharing=False)
    cb.kv_cache_dtype = "fp8_e4m3"
    with broken(name, "faked"):
        assert paged_cache.install(strict=False) is False  # import-time install leaves transformers untouched
        with pytest.raises(hf_kvcache.UnsupportedTransformersError, match="quantized pages"):
            model.generate_batch(
                [[2, 3, 4]],
                generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                continuous_batching_config=cb,
                warmup=False,
            )
        with pytest.raises(hf_kvcache.UnsupportedTransformersError, match="faked"):
            hf_kvcache.enable_paged(model, kv_dtype="int8")
    # model-dtype pages never needed our internals: the same run without kv_cache_dtype works
    plain = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=64, allow_block_sharing=False)
    with broken(name, "faked"):
        out = model.generate_batch(
            [[2, 3, 4]],
            generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
            continuous_batching_config=plain,
            warmup=False,
        )
    assert all(o.error is None for o in out.values())


def test_compilation_asked_for_on_a_broken_auto_compile_contract_raises():
    model = build_model("llama")
    with broken(generation.AUTO_COMPILE):
        with pytest.raises(hf_kvcache.UnsupportedTransformersError, match="_valid_auto_compile_criteria"):
            model.generate(
                random_ids(1, 6),
                max_new_tokens=2,
                do_sample=False,
                cache_implementation="sink",
                cache_config={"sinks": 1, "window": 4},
                compile_config=transformers.CompileConfig(fullgraph=True),
            )


def test_untested_version_imports_with_one_warning_and_checks_raise(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    monkeypatch.setattr(versions, "_warned", False)
    with pytest.warns(UserWarning, match=r"transformers 5\.99\.0 .*>=5\.23,<5\.25"):
        hf_kvcache.register()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_kvcache.register()  # once per process
    with pytest.raises(hf_kvcache.UnsupportedTransformersError, match=r"5\.99\.0.*pip install 'transformers>=5\.23"):
        versions.check_transformers_version()


@pytest.mark.parametrize("version", ["4.57.0", "5.22.9", "5.25.0", "6.0.0"])
def test_versions_outside_the_tested_range_are_not_supported(version):
    assert not versions.is_supported(version)
    with pytest.raises(hf_kvcache.UnsupportedTransformersError, match=version.replace(".", r"\.")):
        versions.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "5.24.9", transformers.__version__])
def test_versions_inside_the_tested_range_are_supported(version):
    versions.check_transformers_version(version)
    assert versions.installed().release[:2] in {tuple(map(int, m.split("."))) for m in versions.TESTED_MINORS}


def test_declared_range_is_the_tested_range():
    """setup.cfg's transformers requirement, SUPPORTED_RANGE_TEXT and TESTED_MINORS say the same thing."""
    setup = (PACKAGE.parent / "setup.cfg").read_text(encoding="utf-8")
    assert f"transformers{versions.SUPPORTED_RANGE_TEXT}" in setup
    low, high = versions.SUPPORTED_TRANSFORMERS
    assert f"{low.major}.{low.minor}" == versions.TESTED_MINORS[0]
    assert (high.major, high.minor - 1) == tuple(map(int, versions.TESTED_MINORS[-1].split(".")))


# -- our own calls raise no deprecation warning -----------------------------------------------------------------


def test_our_own_calls_raise_no_future_warning():
    from hf_kvcache.evaluation.speed import measure_speed

    model = build_model("llama")
    ids = random_ids(1, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for name in ("sink", "h2o", "fp8"):
            model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=name)
        cache = hf_kvcache.SinkCache(model, sinks=1, window=6)
        out = model.generate(
            ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **hf_kvcache.cache_kwargs(cache)
        )
        assert hf_kvcache.returned_cache(out) is cache
        logits = model(input_ids=ids[:, -1:], **hf_kvcache.cache_kwargs(cache), use_cache=True).logits
        assert torch.isfinite(logits).all()
        rows = measure_speed(
            model,
            ids,
            {"sink": lambda: hf_kvcache.SinkCache(model, sinks=1, window=6)},
            prompt_len=8,
            decode_tokens=2,
            rounds=1,
        )
        assert {row["cache"] for row in rows} >= {"sink"}


def test_import_survives_a_broken_generate_contract_with_one_warning():
    from hf_kvcache import install

    with broken(generation.NAMES, "it is a frozenset now"):
        with pytest.warns(UserWarning, match="it is a frozenset now.*cache_implementation=.*unavailable"):
            assert install.register_at_import() is False
    assert install.register_at_import() is True
