#!/usr/bin/env bash
# Create .venv (if missing) and install parallm with its test extras. CPU machines get the CPU torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # A plain `torch` requirement pulls a multi-GB CUDA build; pin the CPU-friendly release.
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[test]"
