"""The house rules of the package (docs/design.md): packages by role in layers checked by import-linter (the
contracts in setup.cfg: each package imports only the ones below it; no import circles between the modules of any
package), a docstring per package saying its job and what it may import, small modules, and the public API."""

from __future__ import annotations

import configparser
import importlib
import io
import pathlib
import tokenize

import pytest
from importlinter.cli import lint_imports

import hf_kvcache

ROOT = pathlib.Path(hf_kvcache.__file__).parent
SETUP = ROOT.parent / "setup.cfg"
# "no module past ~400 lines", counted so that the formatter's layout does not change it (`module_size`): statements,
# comment lines and the lines of multi-line strings. The largest today is policies/composite.py (322).
MAX_SIZE = 330

#: the public API of `import hf_kvcache` (changing it is a release note, not a refactor)
PUBLIC = {
    "CACHE_ARG",
    "CACHE_IMPLEMENTATIONS",
    "CompositeCache",
    "DEFAULT_CACHE_CONFIGS",
    "ExpectedAttentionCache",
    "FullCache",
    "H2OCache",
    "KIVICache",
    "KVCache",
    "KVCacheConfig",
    "KVzapCache",
    "KVzipCache",
    "KeyDiffCache",
    "KnormCache",
    "QuantizedFP8Cache",
    "RandomEvictionCache",
    "SinkCache",
    "SlidingWindowCache",
    "SnapKVCache",
    "TOVACache",
    "UnsupportedTransformersError",
    "build_cache",
    "cache_kwargs",
    "default_cache_config",
    "enable",
    "enable_paged",
    "load_cache_config",
    "load_cache_state",
    "publish",
    "read_cache_state_header",
    "register",
    "returned_cache",
    "save_cache_config",
    "save_cache_state",
}


def _layers() -> list[str]:
    config = configparser.ConfigParser()
    config.read(SETUP)
    return [line.strip() for line in config["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]


def test_import_contracts_are_kept():
    """import-linter (the same run as `lint-imports`): the layers and no import circles, lazy and type-checking imports
    included."""
    assert lint_imports(config_filename=str(SETUP), no_cache=True) == 0


def test_every_package_is_in_the_layers_and_says_what_it_may_import():
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    in_layers = {name.removeprefix("hf_kvcache.") for layer in _layers() for name in layer.split(" | ")}
    assert set(packages) <= in_layers, f"packages missing from the layers contract: {set(packages) - in_layers}"
    for name in packages:
        doc = importlib.import_module(f"hf_kvcache.{name}").__doc__ or ""
        assert len(doc.split()) >= 12, f"hf_kvcache.{name} needs a docstring saying its job"
        if name not in ("integration", "kernels", "policies", "stores", "evaluation", "paged"):
            assert "May import" in doc, f"hf_kvcache.{name}'s docstring must say what it may import"


def test_the_top_level_keeps_little_else():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert modules == ["__init__.py", "install.py", "version.py"]


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    size = module_size(path.read_text(encoding="utf-8"))
    assert size <= MAX_SIZE, f"{path.relative_to(ROOT)} has {size} logical lines (max {MAX_SIZE}): split it by job"


def module_size(source: str) -> int:
    """Logical lines (one a statement, however the formatter wraps it), plus comment-only lines and the lines of
    multi-line strings (docstrings): what a reader reads, independent of line wrapping."""
    size = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NEWLINE:
            size += 1
        elif token.type == tokenize.STRING and token.end[0] > token.start[0]:
            size += token.end[0] - token.start[0]
        elif token.type == tokenize.COMMENT and token.line.lstrip().startswith("#"):
            size += 1
    return size


def test_module_size_ignores_wrapping():
    assert module_size("x = f(1, 2)\n") == module_size("x = f(\n    1,\n    2,\n)\n") == 1
    # the docstring's three lines, the comment line, the statement (a trailing comment is part of its line)
    assert module_size('"""One\ntwo\nthree."""\n# a comment\nx = 1  # trailing\n') == 3 + 1 + 1


def test_public_api():
    assert set(hf_kvcache.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(hf_kvcache, name) is not None
    # the classes are the ones of their packages (no copies), and the names map to them
    from hf_kvcache import caches, sharing  # noqa: F401

    assert hf_kvcache.SinkCache is caches.SinkCache and hf_kvcache.KVCacheConfig is hf_kvcache.sharing.hub.KVCacheConfig
    assert hf_kvcache.CACHE_IMPLEMENTATIONS["sink"] is hf_kvcache.SinkCache
    from hf_kvcache.scorers import SCORERS

    # every scorer is a cache of its own name (hf_kvcache.scorers.registry), besides the caches that rank nothing
    assert set(hf_kvcache.CACHE_IMPLEMENTATIONS) == {"sink", "sliding", "composite", "fp8", "kivi"} | set(SCORERS)
    assert {"h2o", "random_eviction", "knorm", "keydiff", "tova", "snapkv", "expected_attention", "kvzip"} <= set(
        SCORERS
    )
    assert hf_kvcache.__version__ == hf_kvcache.version.__version__


def _slot_view_members() -> set[str]:
    from hf_kvcache.policies.view import SlotView

    return set(SlotView.__annotations__) | {name for name in vars(SlotView) if not name.startswith("_")}


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.py")), ids=lambda p: p.name)
def test_policies_decide_from_what_they_are_given(path):
    """Policies see the layer only through the `SlotView` contract (policies/view.py): no name `layer` in their code,
    and on a `view` only the members the contract declares (so no slot tables, stores or pending tuples reached
    into)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed = _slot_view_members()
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Name) and node.id == "layer"), f"{path.name}:{node.lineno} uses `layer`"
        assert not (isinstance(node, ast.arg) and node.arg == "layer"), f"{path.name}:{node.lineno} takes `layer`"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "view":
            assert node.attr in allowed, f"{path.name}:{node.lineno}: `view.{node.attr}` is not in SlotView"


def test_the_layer_offers_what_the_slot_view_declares():
    from hf_kvcache.layers.slot_view import LayerSlotView

    assert _slot_view_members() <= set(dir(LayerSlotView))


CORE_RUN = """
import sys
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_kvcache
from hf_kvcache.cli.app import build_parser
from hf_kvcache.cli.serve_command import _serve  # noqa: F401  (the command's code, imported as `serve` runs it)
from hf_kvcache.paged.server import build_server  # noqa: F401

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 64, (1, 24))
greedy = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
snapkv = {"budget": 0.5, "recent": 4, "window": 4}
model.generate(ids, generation_config=greedy, cache_implementation="snapkv", cache_config=snapkv)
model.generate(ids, generation_config=greedy, cache_implementation="fp8")
cb = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=64, allow_block_sharing=False)
cb.kv_cache_dtype = "fp8_e4m3"
cb.kv_compress = "keydiff:budget=0.5"
out = model.generate_batch([ids[0].tolist()], generation_config=greedy, continuous_batching_config=cb, warmup=False)
assert all(o.error is None for o in out.values()), [o.error for o in out.values()]
build_parser("serve").parse_args(["serve", "--kv-compress", "keydiff:budget=0.25"])
print(sorted(m for m in sys.modules if m.startswith("hf_kvcache.evaluation")))
"""


def test_the_core_runs_without_the_harness():
    """`generate` with our caches, `generate_batch` with FP8 pages and eviction, and `hf-kvcache serve`'s command and
    server, in a fresh interpreter: no module of the harness (hf_kvcache.evaluation) is loaded. The import contract
    `core-apart` says the same of the code; this checks what really runs."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CORE_RUN], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
