#!/usr/bin/env bash
# The README's test command: installs the headless browser the dashboard tests drive
# (Debian's chromium), then runs the whole test suite. pytest exit code 5 (no tests) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
ruff check .
python -m pytest -q "$@"
