#!/usr/bin/env bash
# verl's own trainer (verl.trainer.main_ppo), GRPO, on CPU: 2 training ranks (gloo), Ray local, vLLM-CPU rollouts,
# a tiny Qwen2 made from a config (parallm.integrations.verl.toy). Runs in .venv-verl (scripts/setup_verl.sh).
#
#   bash examples/verl/grpo_fsdp2_cpu.sh [WORK_DIR] [extra hydra overrides...]
#
# STRATEGY=fsdp2 (default: verl's own FSDP2 engine) or STRATEGY=parallm (parallm's engine through verl's FSDP
# config, parallm's layout from PARALLM_VERL_CONFIG); MODEL_ENGINE=parallm instead selects parallm through verl's
# config groups (model_engine=parallm: actor, reference and critic are parallm's engine, sized by verl's keys given
# as overrides, e.g. actor_rollout_ref.actor.parallm.tensor_model_parallel_size=2; docs/verl.md); STEPS (default 2);
# ADV=grpo (default) or ADV=gae: PPO with a critic (critic.strategy=$STRATEGY; verl 0.9.1's FSDP critic asks
# transformers for flash_attention_2, so on CPU only STRATEGY=parallm runs it); SAVE_FREQ (default -1: no
# checkpoints; N: verl's trainer saves every N steps and at the last one under WORK_DIR/checkpoints/STRATEGY, and
# a later run with the same WORK_DIR and a larger STEPS resumes from the latest one: trainer.resume_mode=auto).
# What makes verl run on CPU (docs/verl.md): VERL_USE_EXTERNAL_MODULES loads parallm.integrations.verl in every
# process (the CPU platform, the engine, the verl 0.9.1 workarounds), VERL_PLATFORM=cpu selects the platform,
# Ray is told of 2 "GPUs" (one slot per training rank) and 16 CPUs, attention is sdpa, vLLM sleep mode is off.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv-verl/bin/python}
WORK=${1:-/tmp/parallm_verl_toy}
shift || true
STRATEGY=${STRATEGY:-fsdp2}
STEPS=${STEPS:-2}
ADV=${ADV:-grpo}
SAVE_FREQ=${SAVE_FREQ:--1}
MODEL_ENGINE=${MODEL_ENGINE:-dp}
if [ "$MODEL_ENGINE" = parallm ]; then
  # verl's config groups of parallm (parallm/integrations/verl/config, on Hydra's search path through parallm's
  # Hydra plugin): the engine settings live in actor_rollout_ref.actor.parallm / critic.parallm
  ENGINE=(model_engine=parallm)
  CRITIC_ENGINE=()
  STRATEGY=parallm
else
  ENGINE=(
    actor_rollout_ref.actor.strategy="$STRATEGY"
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  )
  CRITIC_ENGINE=(
    critic.strategy="$STRATEGY"
    critic.fsdp.use_torch_compile=False
    critic.fsdp.param_offload=False
    critic.fsdp.optimizer_offload=False
  )
fi
CRITIC=()
if [ "$ADV" = gae ]; then
  CRITIC=(
    critic.model.path="$WORK/model"
    +critic.model.override_config.attn_implementation=sdpa
    critic.model.use_remove_padding=False
    critic.model.enable_gradient_checkpointing=False
    critic.optim.lr=1e-3
    critic.ppo_micro_batch_size_per_gpu=2
    "${CRITIC_ENGINE[@]}"
  )
fi
[ -f "$WORK/model/config.json" ] || "$PY" -m parallm.integrations.verl.toy "$WORK" >/dev/null

export VERL_USE_EXTERNAL_MODULES=parallm.integrations.verl VERL_PLATFORM=cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1
export TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}

exec "$PY" -m verl.trainer.main_ppo \
  algorithm.adv_estimator="$ADV" \
  algorithm.use_kl_in_reward=False \
  data.train_files="$WORK/data/train.parquet" \
  data.val_files="$WORK/data/val.parquet" \
  data.train_batch_size=4 \
  data.max_prompt_length=16 \
  data.max_response_length=8 \
  data.filter_overlong_prompts=False \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$WORK/model" \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.model.use_remove_padding=False \
  actor_rollout_ref.model.enable_gradient_checkpointing=False \
  "${ENGINE[@]}" \
  actor_rollout_ref.actor.optim.lr=1e-3 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.use_torch_compile=False \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=2 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
  +actor_rollout_ref.rollout.enable_sleep_mode=False \
  actor_rollout_ref.rollout.enforce_eager=True \
  actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.rollout.max_num_seqs=16 \
  actor_rollout_ref.rollout.max_num_batched_tokens=256 \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
  reward.custom_reward_function.path="$PWD/src/parallm/integrations/verl/toy.py" \
  reward.custom_reward_function.name=compute_score \
  reward.num_workers=1 \
  trainer.device=cpu \
  trainer.n_gpus_per_node=2 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$STEPS" \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq="$SAVE_FREQ" \
  trainer.logger=console \
  trainer.project_name=parallm_verl \
  trainer.experiment_name="${ADV}_${STRATEGY}_cpu" \
  trainer.default_local_dir="$WORK/checkpoints/$STRATEGY" \
  ray_kwargs.ray_init.num_cpus=16 \
  +ray_kwargs.ray_init.num_gpus=2 \
  "${CRITIC[@]}" \
  "$@"
