#!/usr/bin/env bash
# Installs Debian's headless Chromium (used to render the Component Benchmark's icicle view in a test).
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] || { echo "chromium missing and apt-get unavailable" >&2; exit 1; }
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
