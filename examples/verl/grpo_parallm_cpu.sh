#!/usr/bin/env bash
# The same run as grpo_fsdp2_cpu.sh with parallm's engine selected by verl's config (MODEL_ENGINE=parallm:
# model_engine=parallm, parallm's config groups; docs/verl.md) and sized by verl's keys given as overrides, e.g.
#   bash examples/verl/grpo_parallm_cpu.sh /tmp/parallm_verl_toy actor_rollout_ref.actor.parallm.tensor_model_parallel_size=2
# (both CPU ranks one tp2 replica; the reference policy and a critic, ADV=gae, take the actor's layout).
#   bash examples/verl/grpo_parallm_cpu.sh [WORK_DIR] [extra hydra overrides...]
MODEL_ENGINE=parallm exec bash "$(dirname "$0")/grpo_fsdp2_cpu.sh" "$@"
