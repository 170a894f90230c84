#!/usr/bin/env bash
# The virtual environment of NVIDIA kvpress, kept apart from ours: kvpress 0.5.5 pins transformers<5.3 and we need
# >=5.23. Same Python and torch (pinned: an unpinned torch pulls several GB of CUDA wheels on a CPU machine).
# Idempotent (a stamp records the pins).      eval/peers/setup_kvpress.sh [VENV]   (default .venv-kvpress)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-kvpress}"
TORCH="torch==${HF_KVCACHE_TORCH:-2.13.0}"
PINS=("kvpress==0.5.5" "transformers==5.2.0" "$TORCH")
STAMP="$VENV/.peer-$(echo "${PINS[*]}" | sha1sum | cut -c1-12)"
[ -f "$STAMP" ] && exit 0
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { grep -v "^WARNING: Location .* is ignored" || true; }  # this machine's pip config lists absent indexes
"${pip[@]}" "$TORCH" 2>&1 | quiet
"${pip[@]}" "${PINS[@]}" 2>&1 | quiet
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('set up $VENV: kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', '/ transformers', transformers.__version__, '/ torch', torch.__version__)"
touch "$STAMP"
