#!/usr/bin/env bash
# Sets up what is missing, then runs the tests (CPU; GPU tests skip without CUDA) on 2 pytest-xdist workers.
#   bash scripts/test.sh                  the whole suite (what CI runs, after `ruff check .`): 14–19 min on 2 cores
#                                         (~20 min on one worker, `-n 0`)
#   bash scripts/test.sh -m "not slow"    the fast tier: leaves out the tests marked slow
#                                         (train.py subprocesses, several ranks, Triton-interpreter runs,
#                                         the package install)
#   bash scripts/test.sh [pytest args]    any other selection, e.g. tests/test_metrics.py -x -n 0
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash scripts/setup_chromium.sh || echo "warning: no Chromium; the icicle-render test will be skipped"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"
