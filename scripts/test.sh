#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest tests -q --durations=15 "$@"
