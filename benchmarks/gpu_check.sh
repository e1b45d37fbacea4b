#!/usr/bin/env bash
# The GPU check (docs/scale.md "GPU check"): one command, under 5 minutes on an offline machine with one
# GPU where only PyTorch, transformers, accelerate and numpy are installed. Everything else steadyrl needs comes from
# wheels in a local folder (requirements/gpu_check.txt); steadyrl itself runs from this source tree (PYTHONPATH).
#
#   bash benchmarks/gpu_check.sh --fetch   # where pip reaches an index: the wheels into .whl/ (26 wheels, 35 MiB)
#   bash benchmarks/gpu_check.sh           # on the GPU machine: install the wheels, run benchmarks/gpu_check.py
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny bash benchmarks/gpu_check.sh   # the CPU smoke run (a minute)
#
# Environment (all optional):
#   GPU_CHECK_WHEELS          the wheel folder (default: <repo>/.whl, ignored by git)
#   GPU_CHECK_PYTHON_VERSION  --fetch: the Python the wheels are for (default 3.12, the GPU machine's)
#   GPU_CHECK_BUILD_PYTHON    --fetch: a Python of that version to build the wheels PyPI lacks (pycosat is
#                             compiled; cellpylib and zss are pure Python); default: python<version> on PATH, then
#                             pyenv's
#   GPU_CHECK_SITE            where the wheels are installed (default /tmp/site)
#   PYTHON                    the interpreter that has torch (default python3)
#   GPU_CHECK_DEVICE, GPU_CHECK_SIZE, OUT   read by benchmarks/gpu_check.py (cuda | cpu; gpu | tiny; JSON folder)
# Other arguments go to benchmarks/gpu_check.py (`bash benchmarks/gpu_check.sh --help` lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
requirements="$root/requirements/gpu_check.txt"
wheels="${GPU_CHECK_WHEELS:-$root/.whl}"
py="${PYTHON:-python3}"
# Lines of requirements/gpu_check.txt marked `# build`: no wheel on PyPI, so --fetch builds one with pip wheel.
build_marker='# build'

build_python() {  # a Python of version $1 (to build the sdist-only packages as its wheels)
  local version="$1"
  if [ -n "${GPU_CHECK_BUILD_PYTHON:-}" ]; then
    echo "$GPU_CHECK_BUILD_PYTHON"
  elif command -v "python$version" >/dev/null 2>&1 && "python$version" -c "" 2>/dev/null; then
    echo "python$version"
  elif command -v pyenv >/dev/null 2>&1 && compgen -G "$(pyenv root)/versions/$version*/bin/python$version" >/dev/null; then
    compgen -G "$(pyenv root)/versions/$version*/bin/python$version" | sort -V | tail -1
  else
    echo "gpu_check.sh --fetch: no Python $version found to build pycosat (no wheel on PyPI); set" \
      "GPU_CHECK_BUILD_PYTHON to one" >&2
    return 1
  fi
}

fetch() {
  local version="${GPU_CHECK_PYTHON_VERSION:-3.12}" builder binary built
  builder="$(build_python "$version")"
  "$builder" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" ||
    { echo "gpu_check.sh --fetch: $builder is not Python $version" >&2; return 1; }
  mkdir -p "$wheels"
  binary="$(mktemp)"
  built="$(grep -F "$build_marker" "$requirements" | sed 's/#.*//' | tr -s ' \n' ' ')"
  grep -vF "$build_marker" "$requirements" >"$binary"
  echo "[gpu_check] fetching wheels for CPython $version into $wheels" >&2
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$wheels" -r "$binary"
  rm -f "$binary"
  echo "[gpu_check] building wheels of $built with $builder" >&2
  # shellcheck disable=SC2086  # $built is a list of requirement specifiers
  "$builder" -m pip wheel -q --no-deps -w "$wheels" $built
  echo "[gpu_check] $(find "$wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$wheels" | cut -f1) in $wheels" >&2
}

install_wheels() {
  local site="${GPU_CHECK_SITE:-/tmp/site}" dupes
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "gpu_check.sh: no wheels in $wheels; run \`bash benchmarks/gpu_check.sh --fetch\` first where pip reaches" \
      "an index (set GPU_CHECK_WHEELS for another folder)" >&2
    return 2
  fi
  # two versions of one package stop the whole install: name them instead
  dupes="$(find "$wheels" -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
  if [ -n "$dupes" ]; then
    echo "gpu_check.sh: $wheels holds more than one version of: $dupes (keep one)" >&2
    return 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site:$root/src${PYTHONPATH:+:$PYTHONPATH}"
}

if [ "${1:-}" = "--fetch" ]; then
  fetch
  exit 0
fi
install_wheels
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the carried transformers must be the one imported (the image's own is older than steadyrl needs)
"$py" - <<'PY' || exit 2
import sys
import torch, transformers
print(f"[gpu_check] python {sys.version.split()[0]}, torch {torch.__version__} ({torch.__file__}), "
      f"transformers {transformers.__version__} ({transformers.__file__})", file=sys.stderr)
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
if (major, minor) < (5, 19):
    sys.exit(f"gpu_check.sh: transformers {transformers.__version__} is imported, steadyrl needs >= 5.19: the "
             "carried wheel did not install (rerun --fetch)")
PY
exec "$py" "$root/benchmarks/gpu_check.py" "$@"
