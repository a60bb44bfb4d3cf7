#!/usr/bin/env bash
# Sets up what is missing, then runs the whole test suite (CPU; GPU tests skip without CUDA).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/setup_chromium.sh || echo "warning: no Chromium; the icicle-render test will be skipped"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
