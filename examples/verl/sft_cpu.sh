#!/usr/bin/env bash
# verl's own SFT trainer (verl.trainer.sft_trainer, launched with torchrun as verl documents it) on CPU: 2 ranks
# (gloo), the toy Qwen2 of parallm.integrations.verl.toy (made with transformers from a config) with a chat template
# whose turns end in a newline, and 32 two-turn conversations in verl's SFT parquet layout (a "messages" column).
# Runs in .venv-verl (scripts/setup_verl.sh).
#
#   bash examples/verl/sft_cpu.sh [WORK_DIR] [extra hydra overrides...]
#
# ENGINE=parallm (default): parallm's engine, selected and sized by verl's config (engine=parallm optim=parallm;
#   parallm's config groups reach Hydra through parallm's Hydra plugin, docs/verl.md), e.g.
#     bash examples/verl/sft_cpu.sh /tmp/parallm_sft engine.tensor_model_parallel_size=2
#     bash examples/verl/sft_cpu.sh /tmp/parallm_sft engine.pipeline_model_parallel_size=2
# ENGINE=fsdp2: verl's own FSDP2 engine with fp32 parameters and fp32 mixed precision (tests/test_verl_sft.py's
#   reference). NPROC (default 2), STEPS (default 2), LOGGER (default console; [console,file] adds verl's JSONL
#   file logger, written to $VERL_FILE_LOGGER_PATH).
# What makes verl run on CPU: VERL_USE_EXTERNAL_MODULES loads parallm.integrations.verl in every process (the CPU
# platform, the engine, the verl 0.9.1 workarounds), VERL_PLATFORM=cpu selects the platform, trainer.device=cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv-verl/bin/python}
WORK=$(realpath -m "${1:-/tmp/parallm_verl_sft}")
shift || true
ENGINE=${ENGINE:-parallm}
NPROC=${NPROC:-2}
STEPS=${STEPS:-2}
LOGGER=${LOGGER:-console}

if [ ! -f "$WORK/data/train.parquet" ]; then
  "$PY" - "$WORK" <<'PYEOF'
import json, os, random, sys
import pandas as pd
from parallm.integrations.verl import toy
work = sys.argv[1]
model = toy.write_checkpoint(os.path.join(work, "model"), seed=0)
path = os.path.join(model, "tokenizer_config.json")
cfg = json.load(open(path))
# each turn ends in a newline: tokenising turn by turn (verl's MultiTurnSFTDataset) equals the whole conversation
cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
json.dump(cfg, open(path, "w"))
rng = random.Random(0)
letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
words = lambda lo, hi: " ".join(rng.choice(letters) for _ in range(rng.randrange(lo, hi)))
rows = [{"messages": [{"role": "user", "content": words(3, 8)}, {"role": "assistant", "content": words(2, 9)}]}
        for _ in range(32)]
os.makedirs(os.path.join(work, "data"), exist_ok=True)
pd.DataFrame(rows).to_parquet(os.path.join(work, "data", "train.parquet"))
PYEOF
fi

case "$ENGINE" in
  parallm) ENGINE_ARGS=(engine=parallm optim=parallm) ;;
  fsdp2) ENGINE_ARGS=(engine=fsdp optim=fsdp engine.strategy=fsdp2 engine.model_dtype=fp32 engine.use_torch_compile=False
                      +engine.mixed_precision.param_dtype=fp32 +engine.mixed_precision.reduce_dtype=fp32
                      +engine.mixed_precision.buffer_dtype=fp32) ;;
  *) echo "ENGINE must be parallm or fsdp2, got $ENGINE" >&2; exit 2 ;;
esac

export VERL_USE_EXTERNAL_MODULES=parallm.integrations.verl VERL_PLATFORM=cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

exec "$(dirname "$PY")/torchrun" --standalone --nnodes=1 --nproc-per-node="$NPROC" -m verl.trainer.sft_trainer \
  "${ENGINE_ARGS[@]}" \
  data.train_files="$WORK/data/train.parquet" \
  data.train_batch_size=8 \
  data.micro_batch_size_per_gpu=2 \
  data.use_dynamic_bsz=False \
  data.max_length=64 \
  data.num_workers=0 \
  model.path="$WORK/model" \
  +model.override_config.attn_implementation=sdpa \
  model.use_remove_padding=False \
  optim.lr=1e-3 \
  trainer.total_training_steps="$STEPS" \
  trainer.logger="$LOGGER" \
  trainer.device=cpu \
  trainer.resume_mode=disable \
  trainer.project_name=parallm_verl_sft \
  trainer.experiment_name="sft_${ENGINE}_cpu" \
  trainer.default_local_dir="$WORK/checkpoints/$ENGINE" \
  "$@"
