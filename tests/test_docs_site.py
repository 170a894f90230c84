"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and its API page documents every
public name: hf_kvcache.__all__, hf_kvcache.sharing.hub.__all__ and hf_kvcache.kernels.__all__ (`make docs` builds the
same
site into site/)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_kvcache
import hf_kvcache.kernels
import hf_kvcache.sharing.hub

ROOT = Path(__file__).resolve().parent.parent
CACHE_NAMES = tuple(hf_kvcache.CACHE_IMPLEMENTATIONS)  # (scorers added to the registry included)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


_missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if not _installed(m)]
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"documentation tools not installed ({', '.join(_missing)}): `pip install -e .[dev]` or `make docs`",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    assert not re.search(r"^WARNING", log, re.MULTILINE), log[-4000:]
    return out


def _ids(html: str) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', html))


def test_api_page_documents_every_public_name(site):
    ids = _ids((site / "api" / "index.html").read_text(encoding="utf-8"))
    expected = (
        [f"hf_kvcache.{n}" for n in hf_kvcache.__all__]
        + [f"hf_kvcache.sharing.hub.{n}" for n in hf_kvcache.sharing.hub.__all__]
        + [f"hf_kvcache.kernels.{n}" for n in hf_kvcache.kernels.__all__]
    )
    # names re-exported from hf_kvcache.sharing.hub (KVCacheConfig, publish) are documented once, under
    # hf_kvcache.sharing.hub
    aliases = {f"hf_kvcache.{n}": f"hf_kvcache.sharing.hub.{n}" for n in hf_kvcache.sharing.hub.__all__}
    missing = [n for n in expected if n not in ids and aliases.get(n) not in ids]
    assert not missing, f"not on the API page: {missing}"
    # docstrings were rendered, not just headings
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "StreamingLLM" in api and "arXiv 2402.02750" in api


def test_every_page_is_built_and_in_the_nav(site):
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        path = site / "index.html" if page == "index" else site / page / "index.html"
        assert path.is_file(), f"docs/{page}.md was not built"
    home = (site / "index.html").read_text(encoding="utf-8")
    for page in pages:
        if page != "index":
            assert f'href="{page}/"' in home, f"docs/{page}.md is not in the navigation"


def test_caches_page_has_a_section_per_cache_name(site):
    html = (site / "caches" / "index.html").read_text(encoding="utf-8")
    headings = " ".join(re.findall(r"<h2[^>]*>(.*?)</h2>", html, re.DOTALL))
    for name in CACHE_NAMES:
        assert f"<code>{name}</code>" in headings, f"no section for {name!r} on the caches page"


def test_site_builds_offline_without_cdn_fonts(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in home and "fonts.gstatic.com" not in home


def test_results_page_is_generated_from_eval_results():
    """docs/results.md and its plots are what scripts/results_page.py makes of eval/results/ (regenerate with it)."""
    import runpy

    page = runpy.run_path(str(ROOT / "scripts" / "results_page.py"))
    assert page["main"](["--check"]) == 0, "docs/results.md is stale: run python scripts/results_page.py"
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert "eval/results/h2o/results.csv" in text and "eval/results/quantized.json" in text
