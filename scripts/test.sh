#!/usr/bin/env bash
# Set up (once) and run the whole test suite (real model included). Exit status is pytest's
# (non-zero on any failure, and on "no tests collected").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
