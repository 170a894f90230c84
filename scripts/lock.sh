#!/usr/bin/env bash
# Writes requirements/lock.txt from a virtual environment the full suite passed in (default .venv): every installed
# distribution at its exact version, hf-kvcache itself left out, torch without its local "+cpu" label (so the same
# line takes the CPU wheel here and the platform's wheel elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
{
  echo "# The exact versions the test suite passed with (make test / make demo / CI install under these constraints)."
  echo "# Regenerate with 'make lock' after the full suite passes on a newer set (see docs/upstream_contracts.md)."
  "$venv/bin/python" -m pip freeze --disable-pip-version-check --exclude-editable 2>/dev/null \
    | grep -v -i "^hf[-_]kvcache" | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
} > requirements/lock.txt
echo "wrote requirements/lock.txt ($(grep -c '==' requirements/lock.txt) pins, $(grep '^transformers==' requirements/lock.txt))"
