"""The quickstart notebook runs as written (its code cells, in order, in one namespace) on the offline SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(capsys):
    pytest.importorskip("gguf", reason="the offline SmolLM2 needs the gguf package")
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 4
    namespace: dict = {}
    for i, cell in enumerate(cells):
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)
    printed = capsys.readouterr().out
    for name in ("dynamic", "sink", "h2o", "fp8", "kivi", "composite"):
        assert name in printed  # the by-name cell prints one line per cache
    assert namespace["cache"].get_seq_length() == namespace["prompt"].shape[1] + 16
