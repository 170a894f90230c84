#!/usr/bin/env bash
# The kvpress side-by-side in one command (issue 26): kvpress's environment, the offline SmolLM2 (converted by our
# own loader), kvpress's presses on our protocol, then the table joined with our rows.
#   eval/peers/run_kvpress.sh [extra args of kvpress_side_by_side.py, e.g. --budgets 0.2 --only SnapKVPress]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
bash eval/peers/setup_kvpress.sh
MODEL="$(.venv/bin/python -c 'from hf_kvcache.sharing.models import convert_smollm2; print(convert_smollm2())')"
.venv-kvpress/bin/python eval/peers/kvpress_side_by_side.py --model "$MODEL" --out eval/results/peers_kvpress "$@"
.venv/bin/python eval/peers/join_kvpress.py
