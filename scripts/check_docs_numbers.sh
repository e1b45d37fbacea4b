#!/usr/bin/env bash
# Rerun the main job exactly as `bash scripts/main.sh` does (same defaults; extra arguments are its overrides and
# pick the row: `bash scripts/check_docs_numbers.sh method=grpo`), then check that the main-job tables of README.md
# and docs/results.md state what it measured (benchmarks/docs_numbers.py): a stale number fails with its line and both
# values.
# The warm start is rebuilt in a fresh, temporary model cache, as on a fresh clone on a new machine (about 2 minutes
# on 2 cores, then about 1.5 minutes of RL); set STEADYRL_CACHE to reuse a cache instead. Output: runs/check_docs/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="runs/check_docs"
if [ -z "${STEADYRL_CACHE:-}" ]; then
  STEADYRL_CACHE="$(mktemp -d)"
  export STEADYRL_CACHE
  trap 'rm -rf "$STEADYRL_CACHE"' EXIT
fi
bash scripts/main.sh "$@" "out_dir=$out" overwrite=true
.venv/bin/python benchmarks/docs_numbers.py --run "$out" "$@"
