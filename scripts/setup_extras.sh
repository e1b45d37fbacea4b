#!/usr/bin/env bash
# Install the optional test groups into .venv (after scripts/setup.sh): Debian's chromium (root only), the framework
# adapters' packages (requirements/integrations/*.txt), Ray for runtime.mode=ray (requirements/ray.txt) and the
# experiment trackers for log.wandb / log.mlflow (requirements/logging.txt). Each file
# pins exact versions and is installed with --no-deps (each file says which declared requirements it knowingly leaves
# unmet and why), so no version of requirements.lock changes. Idempotent: a stamp keyed by the files makes a second run take a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
shopt -s nullglob
# Headless Chromium for the report's browser test (Debian's package; only where this runs as root with apt-get,
# elsewhere that one test skips and says how to install it).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing Debian's chromium for the report's browser test" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "[setup] could not install chromium; the browser test will skip" >&2
fi
files=(requirements/ray.txt requirements/logging.txt requirements/integrations/*.txt)
existing=()
for f in "${files[@]}"; do [ -f "$f" ] && existing+=("$f"); done
[ ${#existing[@]} -eq 0 ] && exit 0
stamp=".venv/.steadyrl-extras"
want="$(cat "${existing[@]}" requirements.lock | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing the optional test groups: ${existing[*]}" >&2
args=()
for f in "${existing[@]}"; do args+=(-r "$f"); done
.venv/bin/python -m pip install --quiet --no-deps "${args[@]}"
# the pinned core must be untouched
.venv/bin/python - <<'PY'
import importlib.metadata as md, pathlib, re, sys
bad = []
for line in pathlib.Path("requirements.lock").read_text().splitlines():
    m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;#]+)", line.strip())
    if not m:
        continue
    name = re.sub(r"\[.*\]", "", m.group(1))
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    if have.split("+")[0] != m.group(2).split("+")[0]:
        bad.append(f"{name}: lock {m.group(2)}, installed {have}")
if bad:
    sys.exit("[setup] the optional groups changed locked versions: " + "; ".join(bad))
PY
echo "$want" > "$stamp"
