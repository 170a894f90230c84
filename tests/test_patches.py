"""The one list of transformers patches (hf_kvcache.integration.patches): it is complete (a fresh interpreter sees
exactly those attributes change, and no module assigns to a transformers object outside it), `uninstall` restores
transformers' very objects, `install` puts ours back and is idempotent, every patched attribute exists on the
installed transformers, and docs/upstream_contracts.md lists them.

Marked `upstream` (with tests/test_upstream_contracts.py): a moved internal fails here, naming it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import types

import pytest
import transformers

import hf_kvcache
from hf_kvcache.integration import contracts, patches

pytestmark = pytest.mark.upstream

PACKAGE = pathlib.Path(hf_kvcache.__file__).parent
CONTRACTS_DOC = PACKAGE.parent / "docs" / "upstream_contracts.md"


@pytest.fixture
def restored():
    """Whatever a test installs or uninstalls, the groups installed before are installed again afterwards (and only
    those: a group installed lazily stays as the rest of the suite expects it)."""
    before = patches.installed_groups()
    try:
        yield before
    finally:
        patches.uninstall(*[group for group in patches.GROUPS if group not in before])
        patches.install(*before)


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patched_attribute_exists_on_the_installed_transformers(patch):
    assert patch.exists(), (
        f"transformers {transformers.__version__} has no `{patch.name}`, which hf_kvcache patches "
        f"({patch.why}); see hf_kvcache.integration.patches"
    )
    assert patch.group in patches.GROUPS
    assert patch.contracts and set(patch.contracts) <= set(contracts.CONTRACTS), patch.contracts
    assert patch.name in patches._makes, f"nothing provides the replacement of {patch.name} ({patch.replacement})"


def test_a_missing_attribute_is_named():
    fake = patches.Patch("Fake", types.SimpleNamespace(), "gone", patches.GENERATE, (), "here", "a test")
    assert not fake.exists()
    with pytest.raises(AttributeError, match=r"`Fake\.gone`"):
        fake.current()


def _transformers_own(value) -> bool:
    if isinstance(value, tuple):
        return not set(value) & set(hf_kvcache.CACHE_IMPLEMENTATIONS)
    return getattr(value, "__module__", "").startswith("transformers.")


def test_uninstall_restores_transformers_objects_and_install_puts_ours_back(restored):
    patches.install()  # every group, the lazy ones included
    ours = {p.name: p.current() for p in patches.PATCHES}
    saved = {p.name: patches.original(p) for p in patches.PATCHES}
    for patch in patches.PATCHES:
        assert patches.is_applied(patch) and saved[patch.name] is not ours[patch.name], patch.name
        assert _transformers_own(saved[patch.name]), f"{patch.name}: the saved original is {saved[patch.name]!r}"
    patches.uninstall()
    assert patches.installed_groups() == []
    for patch in patches.PATCHES:
        assert patch.current() is saved[patch.name], f"uninstall left {patch.name} at {patch.current()!r}"
    with pytest.raises(ValueError):
        transformers.GenerationConfig(cache_implementation="sink").validate(strict=True)
    patches.install()
    for patch in patches.PATCHES:
        assert patches.is_applied(patch) and patches.original(patch) is saved[patch.name], patch.name
        again = patch.current()
        # (a value or a wrapper made from the original is a new object each install)
        assert (
            again is ours[patch.name]
            or again == ours[patch.name]
            or (getattr(again, "__module__", "").startswith("hf_kvcache.") and again is not saved[patch.name])
        ), f"{patch.name}: {again!r}"
    transformers.GenerationConfig(cache_implementation="sink").validate(strict=True)


def test_install_is_idempotent(restored):
    patches.install()
    first = {p.name: p.current() for p in patches.PATCHES}
    patches.install()
    hf_kvcache.register()  # (re-applies the names, unchanged)
    for patch in patches.PATCHES:
        assert patch.current() is first[patch.name], f"installing twice replaced {patch.name} again"
    assert not hasattr(patches.original(patches.BY_NAME["GenerationMixin._prepare_cache_for_generation"]), "original")


def test_the_import_installs_the_import_groups():
    assert set(patches.installed_groups()) >= {patches.CACHE_NAMES, patches.GENERATE, patches.PAGED_CACHE}


FRESH = """
import sys, types
import transformers.generation.configuration_utils, transformers.generation.utils, transformers.modeling_utils
import transformers.masking_utils, transformers.cache_utils
import transformers.generation.continuous_batching.continuous_api, transformers.generation.continuous_batching.cache
import transformers.generation.continuous_batching.scheduler

def owners():
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(("transformers.generation", "transformers.modeling_utils", "transformers.masking_utils",
                                "transformers.cache_utils")) or not isinstance(module, types.ModuleType):
            continue
        found[id(module)] = (name, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__.startswith("transformers"):
                found[id(value)] = (f"{value.__module__}.{value.__qualname__}", value)
                mapping = vars(value).get("_global_mapping")
                if isinstance(mapping, dict):
                    found[id(mapping)] = (f"{value.__qualname__}._global_mapping", mapping)
    return found

def snapshot():
    found = owners().items()
    return {key: (label, obj, dict(obj if isinstance(obj, dict) else vars(obj))) for key, (label, obj) in found}

def changed(before):
    out = []
    for label, obj, saved in before.values():
        now = obj if isinstance(obj, dict) else vars(obj)
        out += [(obj, label, k) for k, v in saved.items() if now.get(k, saved) is not v]
        if type(obj).__name__ != "_LazyModule":  # (a lazy module adds what it loads on first access)
            registered = isinstance(obj, dict)  # (our own names in the attention registries: not patches)
            out += [(obj, label, k) for k in now if k not in saved and not (registered and k.startswith("hf_kvcache"))]
    return out

before = snapshot()
import hf_kvcache
from hf_kvcache.integration import patches
patches.install()
listed = {(id(p.owner), p.attribute) for p in patches.PATCHES}
found = changed(before)
unlisted = [f"{label}.{k}" for obj, label, k in found if (id(obj), k) not in listed]
assert not unlisted, f"changed on transformers but not in hf_kvcache.integration.patches.PATCHES: {unlisted}"
assert len(found) == len(listed), (sorted(f"{label}.{k}" for _, label, k in found), sorted(patches.BY_NAME))
patches.uninstall()
left = [f"{label}.{k}" for _, label, k in changed(before)]
assert not left, f"uninstall did not restore {left}"
print("ok", len(found))
"""


def test_a_fresh_interpreter_sees_exactly_the_listed_patches_and_uninstall_restores_them():
    """Before `import hf_kvcache`, the attributes of transformers' generation, modeling, masking and cache modules
    and of their classes (and the attention registries) are recorded; with every group installed, exactly the
    listed ones changed; after `uninstall`, each is the very object it was (new keys of ours in the attention
    registries, `hf_kvcache_*`, are registrations, not patches)."""
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", str(len(patches.PATCHES))]


# -- no patch outside the list ----------------------------------------------------------------------------------

#: mutations of transformers objects that are not patches, with the reason
ALLOWED = {
    ("attention/bridge.py", "AttentionInterface.register"): "our own names, through the public registry",
    ("attention/bridge.py", "AttentionMaskInterface.register"): "our own names, through the public registry",
    ("evaluation/eviction_reference.py", "AttentionInterface.register"): "our own name, through the public registry",
    (
        "evaluation/eviction_reference.py",
        "AttentionMaskInterface.register",
    ): "our own name, through the public registry",
    ("integration/continuous_batching.py", "cb_cache.ATTN_TYPE_TO_ALLOCATOR.update"): "while one cache is built",
    ("integration/continuous_batching.py", "cb_cache.ATTN_TYPE_TO_ALLOCATOR.clear"): "restored after that build",
}
MUTATORS = {"register", "update", "clear", "pop", "popitem", "setdefault", "append", "extend", "insert", "remove"}


def _root(node) -> tuple[str | None, str]:
    """The name an attribute / subscript chain starts from, and the chain as text."""
    text = ast.unparse(node)
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), text


def _transformers_names(tree) -> set[str]:
    """Names bound in a module to transformers objects: imports from transformers, and aliases of them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("transformers"):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("transformers")}
    for node in ast.walk(tree):  # `scheduler = cb_scheduler.Scheduler` and the like
        alias = isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute))
        if alias and _root(node.value)[0] in names:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _mutations(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    ours = _transformers_names(tree)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, (ast.Attribute, ast.Subscript)) and _root(part)[0] in ours:
                    yield node.lineno, f"{_root(part)[1]} ="
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in ("setattr", "delattr") and node.args:
                if _root(node.args[0])[0] in ours:
                    yield node.lineno, f"{fn.id}({_root(node.args[0])[1]}, ...)"
            elif isinstance(fn, ast.Attribute) and fn.attr in MUTATORS and _root(fn.value)[0] in ours:
                yield node.lineno, _root(fn)[1]


def test_no_module_patches_transformers_outside_the_list():
    """Assignments, setattr / delattr and mutating calls on a name bound to a transformers object, in every module
    but integration/patches.py: a new patch belongs in PATCHES (an instance of the user's, e.g. a model, is not
    bound to a transformers name and so is not caught, as intended)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "integration/patches.py":
            continue
        for line, what in _mutations(path):
            key = (relative, what.removesuffix(" ="))
            if key not in ALLOWED:
                offenders.append(f"hf_kvcache/{relative}:{line}: {what}")
    assert not offenders, "declare it in hf_kvcache/integration/patches.py instead:\n" + "\n".join(offenders)


def test_the_scan_finds_a_scattered_patch(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from transformers.generation.utils import GenerationMixin\n"
        "from transformers.generation.continuous_batching import scheduler as cb\n"
        "import transformers\n"
        "GenerationMixin.generate = None\n"
        "s = cb.Scheduler\n"
        "s._schedule_request, x = None, 1\n"
        "setattr(transformers.GenerationConfig, 'validate', None)\n"
        "transformers.AttentionInterface.register('sdpa', None)\n"
        "model.generate = None\n"
    )
    found = [what for _, what in sorted(_mutations(module))]
    assert found == [
        "GenerationMixin.generate =",
        "s._schedule_request =",
        "setattr(transformers.GenerationConfig, ...)",
        "transformers.AttentionInterface.register",
    ]


def test_patch_listing_in_the_docs_is_current():
    """docs/upstream_contracts.md lists every patch, generated from PATCHES (cannot drift)."""
    table = patches.markdown_table()
    assert table in CONTRACTS_DOC.read_text(encoding="utf-8"), (
        f"regenerate the patches table in {CONTRACTS_DOC} (python scripts/upstream_contracts_table.py):\n{table}"
    )
