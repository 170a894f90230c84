"""ruff's lint and format checks over the repository, as configured in pyproject.toml ([tool.ruff]): `make test`
fails on a finding, so new code starts clean. (A finding left on purpose is ignored there or on its line, with the
reason.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize("command", [["check", "--output-format", "concise"], ["format", "--check"]])
def test_ruff(command):
    done = subprocess.run([_ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff {' '.join(command)}:\n{done.stdout}{done.stderr}"
