"""README.md's and docs/index.md's Python snippets run as written on the offline SmolLM2 (tests/readme_snippets.py):
an API change that breaks them fails here."""

from __future__ import annotations

import pytest
from readme_snippets import PAGES, program, snippets


def test_each_first_page_has_snippets():
    assert all(snippets(page) for page in PAGES), "a page lost its Python snippets: update PAGES"


@pytest.mark.slow
def test_readme_snippets_run_on_the_offline_model(capsys):
    exec(compile(program(), "readme_snippets", "exec"), {"__name__": "readme_snippets"})
    printed = capsys.readouterr().out
    assert "README.md, python block 2" in printed and "snippets ran:" in printed
