"""One version everywhere: `hf_kvcache.__version__` (which setup.cfg reads for the wheel), CHANGELOG.md's newest entry,
the documentation's home page and `hf-kvcache --version`. (tests/test_wheel.py checks the built wheel's metadata.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

import hf_kvcache
from hf_kvcache.cli.app import build_parser

ROOT = Path(__file__).resolve().parents[1]


def changelog_versions() -> list[tuple[str, str]]:
    """(version, date) of each `## X.Y.Z (YYYY-MM-DD)` entry, in file order."""
    return re.findall(r"^## (\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)$", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_changelog_starts_at_the_package_version_and_goes_back_in_order():
    entries = changelog_versions()
    assert entries and entries[0][0] == hf_kvcache.__version__
    versions = [Version(v) for v, _ in entries]
    dates = [d for _, d in entries]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert dates == sorted(dates, reverse=True)


def test_the_docs_and_the_build_read_the_same_version():
    assert f"hf-kvcache **{hf_kvcache.__version__}**" in (ROOT / "docs/index.md").read_text()
    assert "version = attr: hf_kvcache.version.__version__" in (ROOT / "setup.cfg").read_text()
    assert "include CHANGELOG.md" in (ROOT / "MANIFEST.in").read_text().splitlines()


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"hf-kvcache {hf_kvcache.__version__}"
