#!/usr/bin/env bash
# Set up (once) and stream a generation from the default model; statistics (tokens/s) on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/tokenleap generate "${1:-Explain in three sentences why the sky is blue.}" --temperature 0 --max-tokens 128
