#!/usr/bin/env bash
# GPU smoke: scripts/gpu_smoke.py (logits, log-probs, export, an AdamW step, a training checkpoint, MoE, kernel
# choices, YaRN, big pipeline messages, throughput against transformers on CUDA + NCCL, every visible GPU: 1, 2
# or 4), then scripts/gpu_checks/: train.py (offload on CUDA, the MoE token count beside NCCL gradient messages,
# one world collective per call, an empty replica), replay.py (router replay against transformers with its
# routers forced, fp32 and bf16, at ep = every GPU), lora.py (LoRA against PEFT on the GPU at tp = every GPU, fp32
# and bf16; needs peft), attention.py (one process: the context-parallel CUDA block kernel and sliding
# windows) and gated_deltanet.py (1-2 processes: the fla kernels against the torch recurrence, Qwen3.5 logits;
# pip install -e ".[gpu]" first), and with vLLM's CUDA build and 2 GPUs vllm.py (an engine beside a resident
# trainer, pushes, vLLM's NCCL backend fed by export_source), and with verl installed verl_engine.py (parallm's engine
# offloading through verl's mode switches on CUDA, bit-equal to a resident run; the delta sync's exports). Every part runs even when an earlier one fails; the exit status is non-zero when any
# failed. Extra arguments go to every script (--cpu: a dry run on gloo / CPU). Never run on a GPU yet.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
N=$("$PY" -c "import torch; n=torch.cuda.device_count(); print(4 if n>=4 else (2 if n>=2 else 1))")
status=0
echo "== scripts/gpu_smoke.py on $N process(es)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_smoke.py "$@" || status=1
echo "== scripts/gpu_checks/train.py on $N process(es)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_checks/train.py "$@" || status=1
echo "== scripts/gpu_checks/replay.py on $N process(es)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_checks/replay.py "$@" || status=1
echo "== scripts/gpu_checks/verify.py (parallm verify in bf16, MTP tensors carried)"
"$PY" scripts/gpu_checks/verify.py || status=1
echo "== scripts/gpu_checks/attention.py"
"$PY" scripts/gpu_checks/attention.py "$@" || status=1
N2=$(( N >= 2 ? 2 : 1 ))
echo "== scripts/gpu_checks/gated_deltanet.py on $N2 process(es)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N2" scripts/gpu_checks/gated_deltanet.py "$@" || status=1
echo "== scripts/gpu_checks/mamba2.py on $N2 process(es) (Nemotron-H: mamba-ssm / causal-conv1d against the torch scan)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N2" scripts/gpu_checks/mamba2.py "$@" || status=1
echo "== scripts/gpu_checks/gpt_oss.py (gpt-oss: biased clamped experts on the device, parallm verify with sinks)"
"$PY" scripts/gpu_checks/gpt_oss.py || status=1
echo "== scripts/gpu_checks/dsa.py (DeepSeek Sparse Attention: indexer + sparse latent attention on the device)"
"$PY" scripts/gpu_checks/dsa.py "$@" || status=1
if "$PY" -c "import peft" 2>/dev/null; then
  echo "== scripts/gpu_checks/lora.py on $N process(es)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_checks/lora.py "$@" || status=1
else
  echo "== scripts/gpu_checks/lora.py not run: needs peft (pip install peft)"
fi
if [ "$N" -ge 2 ]; then
  echo "== scripts/gpu_checks/export_out.py on 2 processes (the export stream writing into caller buffers)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_checks/export_out.py || status=1
fi
echo "== scripts/gpu_checks/vllm_remote.py on $N process(es) (a CUDA trainer's push into engines in other processes)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" scripts/gpu_checks/vllm_remote.py "$@" || status=1
if [ "$N" -ge 2 ] && "$PY" -c "import vllm" 2>/dev/null; then
  echo "== scripts/gpu_checks/vllm.py on 2 processes"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_checks/vllm.py || status=1
else
  echo "== scripts/gpu_checks/vllm.py not run: needs vLLM's CUDA build (pip install vllm) and 2 GPUs"
fi
if "$PY" -c "import verl" 2>/dev/null; then
  echo "== scripts/gpu_checks/verl_engine.py on 1 process"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu_checks/verl_engine.py || status=1
else
  echo "== scripts/gpu_checks/verl_engine.py not run: needs verl (pip install \"verl[verl-core]==0.9.1\")"
fi
exit "$status"
