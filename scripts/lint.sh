#!/usr/bin/env bash
# Lint and type-check, as configured in pyproject.toml: `ruff check` (src/, tests/, benchmarks/,
# scripts/, examples/) and `mypy` (src/tokenleap). Both always run; the exit status is non-zero
# when either finds a problem. Needs the dev extra (scripts/setup.sh installs it).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "[lint] ruff check" >&2
.venv/bin/python -m ruff check || status=1
echo "[lint] mypy" >&2
.venv/bin/python -m mypy || status=1
exit "$status"
