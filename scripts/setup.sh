#!/usr/bin/env bash
# Creates ./.venv with everything loka_trainer needs on a CPU-only machine; does nothing that is already done.
#   bash scripts/setup.sh
# torchrec's wheel asks for the 2.7 GB CUDA fbgemm-gpu; on CPU we pair it with fbgemm-gpu-cpu and install
# torchrec with --no-deps plus its other requirements. Never install both fbgemm packages in one env.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${LOKA_VENV:-$root/.venv}"
# Re-run the installs whenever this script or the requirements change.
stamp="$venv/.loka-setup-$(cat "$0" "$root/requirements-cpu.txt" "$root/pyproject.toml" | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
"${pip[@]}" -r "$root/requirements-cpu.txt"
"${pip[@]}" --no-deps -e "$root"
rm -f "$venv"/.loka-setup-*
touch "$stamp"
