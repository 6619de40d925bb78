#!/usr/bin/env bash
# The same run as grpo_fsdp2_cpu.sh with parallm's engine (actor_rollout_ref.actor.strategy=parallm); parallm's
# layout from PARALLM_VERL_CONFIG, e.g. PARALLM_VERL_CONFIG='{"tp": 2}' (both CPU ranks one tp2 replica).
#   bash examples/verl/grpo_parallm_cpu.sh [WORK_DIR] [extra hydra overrides...]
STRATEGY=parallm exec bash "$(dirname "$0")/grpo_fsdp2_cpu.sh" "$@"
