#!/usr/bin/env bash
# Create .venv-kernels (idempotent): the real Triton kernel libraries parallm calls (flash-linear-attention for
# Gated DeltaNet, mamba-ssm's SSD scan for Mamba-2) on a CPU machine, for tests/test_kernels_interpreted.py, which
# runs them through Triton's interpreter (TRITON_INTERPRET=1; docs/testing.md, "Kernel libraries on CPU").
#
# Why these versions:
# - triton 3.6.0 and numpy < 2.3: the interpreter turns a program id into a Python int with int() of a 1-element
#   numpy array; numpy 2.3+ refuses that (TypeError: only 0-dimensional arrays can be converted to Python scalars,
#   raised in mamba-ssm's _chunk_state_fwd_kernel and fla 0.5.2's kkt solve). 3.6.0 is the tested Triton;
#   fla 0.5.2 does not import with triton 3.9 (an autotune key that is not a kernel argument).
# - fla-core / flash-linear-attention 0.6.0: its causal_conv1d runs; its chunk_gated_delta_rule runs only with the
#   `range` shim the test applies to fla.ops.common.chunk_delta_h (0.4.2 / 0.5.2 / 0.6.0 alike): docs/testing.md.
# - mamba-ssm 2.3.2.post1's Python package only: its CUDA extensions cannot build here (no nvcc), and even with
#   MAMBA_SKIP_CUDA_BUILD=TRUE the wheel build fails on this machine, so the sdist's mamba_ssm/ folder is copied
#   into site-packages (the Triton SSD kernels are pure Python + Triton). causal-conv1d (Mamba-2's conv) is CUDA
#   C++, not Triton: not installed.
# Run time here: about 4 minutes on 2 shared cores (mostly downloads); the test file itself 12-60 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PARALLM_KERNELS_VENV:-.venv-kernels}
TRITON=3.6.0
FLA=0.6.0
MAMBA=2.3.2.post1
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
echo "*" > "$VENV/.gitignore"    # the venv ignores itself
"$VENV/bin/pip" install -q "torch==2.13.0" "triton==$TRITON" "numpy<2.3" "fla-core==$FLA" \
  "flash-linear-attention==$FLA" "einops>=0.8" "pytest>=8" "pytest-timeout>=2.3"
# parallm itself, editable; pins repeated so its dependencies cannot move torch / triton / numpy
"$VENV/bin/pip" install -q -e . "torch==2.13.0" "triton==$TRITON" "numpy<2.3"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ ! -f "$SITE/mamba_ssm/ops/triton/ssd_combined.py" ]; then
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  MAMBA_SKIP_CUDA_BUILD=TRUE "$VENV/bin/pip" download -q --no-deps --no-build-isolation -d "$TMP" "mamba-ssm==$MAMBA"
  tar -xzf "$TMP"/mamba_ssm-*.tar.gz -C "$TMP"
  cp -r "$TMP"/mamba_ssm-*/mamba_ssm "$SITE/"
fi
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, numpy, torch, triton
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert triton.__version__ == "3.6.0", triton.__version__
assert tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 3), numpy.__version__
print("kernels venv ready: torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__,
      "fla", md.version("fla-core"))
PYEOF
echo "run: OMP_NUM_THREADS=1 $VENV/bin/python -m pytest tests/test_kernels_interpreted.py"
