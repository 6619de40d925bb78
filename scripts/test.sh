#!/usr/bin/env bash
# Set up both venvs (idempotent) and run the tests (docs/testing.md):
#   1. the main suite in .venv, without the vLLM tests; extra arguments go to this pytest (with a path among
#      them, only what they name runs);
#   2. the vLLM tests (tests/test_vllm.py, tests/test_vllm_*.py) in .venv-vllm, made by scripts/setup_vllm.sh, with
#      PARALLM_REQUIRE_VLLM=1: a missing or broken vLLM fails them instead of skipping them.
#   3. the verl tests (tests/test_verl.py) in .venv-verl, made by scripts/setup_verl.sh, with PARALLM_REQUIRE_VERL=1
#      (verl's own trainer runs 3 PPO steps with parallm's actor and critic there).
#   4. the Tinker-server tests (TINKER_TESTS: the tinker SDK and tinker-cookbook against `parallm serve-tinker`) in
#      .venv-tinker, made by scripts/setup_tinker.sh, with PARALLM_REQUIRE_TINKER=1.
#   5. the kernel libraries parallm calls on GPUs (flash-linear-attention, mamba-ssm's SSD scan) under Triton's
#      interpreter against parallm's torch kernels (KERNEL_TESTS) in .venv-kernels, made by
#      scripts/setup_kernels_cpu.sh, with PARALLM_REQUIRE_KERNELS=1.
# PARALLM_TEST_VLLM=0 leaves step 2 and its setup out, PARALLM_TEST_VERL=0 step 3, PARALLM_TEST_TINKER=0 step 4,
# PARALLM_TEST_KERNELS=0 step 5
# (for quick local runs; CI runs all). Every step runs; the exit status is non-zero when any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_TESTS=(tests/test_vllm.py tests/test_vllm_device.py tests/test_vllm_source.py tests/test_vllm_remote.py
            tests/test_vllm_remote_moe.py tests/test_vllm_grpo_serve.py tests/test_vllm_hybrid.py
            tests/test_vllm_lora.py tests/test_vllm_prefix_cache.py tests/test_vllm_serve_lifetime.py
            tests/test_vllm_gpt_oss.py tests/test_vllm_nemotron_h.py tests/test_vllm_deepseek_v4.py
            tests/test_vllm_families.py)
VLLM_VENV=${PARALLM_VLLM_VENV:-.venv-vllm}      # where scripts/setup_vllm.sh puts it
with_vllm=${PARALLM_TEST_VLLM:-1}
VERL_TESTS=(tests/test_verl.py tests/test_verl_sft.py tests/test_verl_config.py tests/test_verl_deepseek_v4.py
            tests/test_verl_families.py)
VERL_VENV=${PARALLM_VERL_VENV:-.venv-verl}      # where scripts/setup_verl.sh puts it
with_verl=${PARALLM_TEST_VERL:-1}
TINKER_TESTS=(tests/test_tinker.py tests/test_tinker_full.py tests/test_tinker_layouts.py tests/test_tinker_ranks.py tests/test_tinker_vllm.py
              tests/test_tinker_hostile.py tests/test_tinker_operations.py tests/test_tinker_stability.py
              tests/test_tinker_deepseek_v4.py tests/test_tinker_push.py tests/test_tinker_cobatch_sdk.py
              tests/test_tinker_families.py tests/test_tinker_engines.py tests/test_tinker_http.py)
TINKER_VENV=${PARALLM_TINKER_VENV:-.venv-tinker}  # where scripts/setup_tinker.sh puts it
with_tinker=${PARALLM_TEST_TINKER:-1}
KERNEL_TESTS=(tests/test_kernels_interpreted.py)
KERNELS_VENV=${PARALLM_KERNELS_VENV:-.venv-kernels}  # where scripts/setup_kernels_cpu.sh puts it
with_kernels=${PARALLM_TEST_KERNELS:-1}
bash scripts/setup.sh
if [ "$with_vllm" != 0 ]; then
  bash scripts/setup_vllm.sh
fi
if [ "$with_verl" != 0 ]; then
  bash scripts/setup_verl.sh
fi
if [ "$with_tinker" != 0 ]; then
  bash scripts/setup_tinker.sh
fi
if [ "$with_kernels" != 0 ]; then
  bash scripts/setup_kernels_cpu.sh
fi
export OMP_NUM_THREADS=1

paths=(tests)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths=(); break; fi      # a path (or path::test) given: run what it names
done
status=0
echo "== main suite (.venv)"
ignore=()
for t in "${VLLM_TESTS[@]}" "${VERL_TESTS[@]}" "${TINKER_TESTS[@]}" "${KERNEL_TESTS[@]}"; do ignore+=("--ignore=$t"); done
.venv/bin/python -m pytest "${paths[@]}" "${ignore[@]}" -q --durations=15 "$@" || status=$?
if [ "$with_vllm" != 0 ]; then
  echo "== vLLM tests ($VLLM_VENV)"
  PARALLM_REQUIRE_VLLM=1 VLLM_LOGGING_LEVEL=WARNING "$VLLM_VENV/bin/python" -m pytest "${VLLM_TESTS[@]}" -q \
    --durations=15 || status=$?
else
  echo "== vLLM tests left out (PARALLM_TEST_VLLM=0)"
fi
if [ "$with_verl" != 0 ]; then
  echo "== verl tests ($VERL_VENV)"
  PARALLM_REQUIRE_VERL=1 VLLM_LOGGING_LEVEL=WARNING "$VERL_VENV/bin/python" -m pytest "${VERL_TESTS[@]}" -q \
    --durations=15 || status=$?
else
  echo "== verl tests left out (PARALLM_TEST_VERL=0)"
fi
if [ "$with_tinker" != 0 ]; then
  echo "== Tinker-server tests ($TINKER_VENV)"
  PARALLM_REQUIRE_TINKER=1 VLLM_LOGGING_LEVEL=WARNING "$TINKER_VENV/bin/python" -m pytest "${TINKER_TESTS[@]}" -q \
    --durations=15 || status=$?
else
  echo "== Tinker-server tests left out (PARALLM_TEST_TINKER=0)"
fi
if [ "$with_kernels" != 0 ]; then
  echo "== kernel libraries under Triton's interpreter ($KERNELS_VENV)"
  PARALLM_REQUIRE_KERNELS=1 TRITON_INTERPRET=1 "$KERNELS_VENV/bin/python" -m pytest "${KERNEL_TESTS[@]}" -q \
    --durations=5 || status=$?
else
  echo "== kernel-library tests left out (PARALLM_TEST_KERNELS=0)"
fi
exit "$status"
