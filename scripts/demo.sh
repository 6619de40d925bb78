#!/usr/bin/env bash
# Set up .venv (idempotent) and run `parallm demo`: tiny LLaMA, Mistral, Qwen3 and Qwen2 checkpoints made with
# transformers, four parallel layouts on 4 local ranks (gloo on CPU, nccl with 4 GPUs), each compared with
# transformers (outputs, one SGD step, save + reload). Extra arguments go to `parallm demo` (--quick, --workdir
# DIR, --help, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/parallm demo "$@"
