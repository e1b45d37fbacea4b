#!/usr/bin/env bash
# Create (or refresh) the virtual environment at .venv in the repo root with the pinned, tested package set.
# Idempotent: a stamp keyed by the lock file and pyproject.toml makes a second run take a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
stamp=".venv/.steadyrl-setup"
want="$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import steadyrl" 2>/dev/null; then
  exit 0
fi
echo "[setup] creating .venv and installing pinned packages (first run: about a minute)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and by exact version: it resolves to the CPU wheel on disk instead of a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -r requirements.lock
.venv/bin/python -m pip install --quiet --no-deps -e . 2>&1 | grep -vE "Warning|!!|\*\*|corresp|return|^ *$|Please|By 20|See https" >&2 || true
.venv/bin/python -c "import steadyrl"
echo "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')" >&2
