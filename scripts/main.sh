#!/usr/bin/env bash
# The main job: set up .venv, then RL-train the embedded default (chain_sum, tiny Llama, seq_tis+ess_lr at lag 16).
# Extra arguments go to `steadyrl train` (e.g. `bash scripts/main.sh runtime.lag.k=32 method=grpo`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/steadyrl train "$@"
