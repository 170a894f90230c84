"""Regenerate docs/support_matrix.md: runs tests/test_support_matrix.py with HF_KVCACHE_WRITE_MATRIX=1.

    python scripts/support_matrix.py            # whole matrix (~1 minute on one CPU thread), rewrites the table
    python scripts/support_matrix.py --check    # same run without rewriting: fails if the table is stale

The table is rendered by the test itself from the results of that run (see the test's module docstring), so what
it says is what the code does. BROKEN cells not listed in the test's KNOWN_FAILURES make the run fail, and the
table is then not written (the last test only writes after every cell ran): fix the library or document the
failure in KNOWN_FAILURES first. Review the diff of docs/support_matrix.md before committing it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/test_support_matrix.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed table instead of writing")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (not -k: the table needs every cell)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if args.check:
        env.pop("HF_KVCACHE_WRITE_MATRIX", None)
    else:
        env["HF_KVCACHE_WRITE_MATRIX"] = "1"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        TEST,
        *args.pytest_args,
    ]
    code = subprocess.call(command, cwd=ROOT, env=env)
    if code == 0 and not args.check:
        print(f"wrote {ROOT / 'docs' / 'support_matrix.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
