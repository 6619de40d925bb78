#!/usr/bin/env bash
# GPU smoke (scripts/gpu_smoke.py): logits, log-probs, export, an AdamW step, a training checkpoint and MoE
# (logits, then ZeRO and a training checkpoint at ep = world) against transformers on CUDA + NCCL. Uses every
# visible GPU (1, 2 or 4). Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
N=$("$PY" -c "import torch; n=torch.cuda.device_count(); print(4 if n>=4 else (2 if n>=2 else 1))")
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_smoke.py "$@"
