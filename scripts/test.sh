#!/usr/bin/env bash
# Set up (once), lint and type-check (scripts/lint.sh), then run the whole test suite (real model
# included). The tests run whatever lint finds; the exit status is pytest's when it fails (also on
# "no tests collected"), else lint's. TOKENLEAP_LINT=0 skips lint (quick local runs; CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
lint=0
if [ "${TOKENLEAP_LINT:-1}" != 0 ]; then
  scripts/lint.sh || lint=$?
fi
.venv/bin/python -m pytest -q --durations=15 "$@"  # the 15 slowest: the suite must stay under 20 min
exit "$lint"
