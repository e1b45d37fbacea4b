#!/usr/bin/env bash
# The one command that passes the tests: sets up .venv (with the optional test groups: framework adapters, Ray),
# checks lint, runs the whole suite (slow tests included).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/setup_extras.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest "$@"
