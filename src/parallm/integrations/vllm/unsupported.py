"""Model families parallm's vLLM integration refuses, with the reason, before an engine starts or a tensor moves
(rather than failing obscurely inside vLLM or in the name check of a push).

DeepSeek-V4 (``DeepseekV4ForCausalLM``), measured with vLLM 0.32's CPU build (docs/deepseek_v4.md, "vLLM"):
vLLM registers the architecture and, for a checkpoint shaped as its CPU kernels require (``head_dim``
512, ``index_head_dim`` 128, a 64-channel RoPE, Hub tensor names, ``topk_method: noaux_tc``), builds the model and
loads its weights; its first forward then fails in the sparse sliding-window attention's metadata
(``vllm/v1/attention/ops/metadata.py``, ``compute_token_to_req_indices``), which launches a Triton kernel: the
CPU build runs without Triton's CPU backend (triton-cpu, not on PyPI), and the call raises ``TypeError:
'function' object is not subscriptable``. Pushing into a GPU build is refused too: untested, and parallm's export
names V4's tensors as transformers saves them, not in the Hub spelling vLLM's V4 loader reads.

MiniMax-M2 (``minimax_m2``) where this process's vLLM is the CPU build: vLLM builds the model and loads its
weights, then its first forward (the start-up profiling run) fails in the CPU router
(``fused_moe/router/cpu_router.py``, ``_compute_routing``: ``assert self.scoring_func == "softmax"``): outside
grouped top-k, the CPU router takes softmax routing only, and MiniMax-M2 routes with a sigmoid and a correction
bias, ungrouped.

Qwen3.5 / Qwen3.6 (``qwen3_5`` / ``qwen3_5_moe``, text and VL classes) where the vLLM installed here cannot import
its model file (checked, not assumed): vLLM 0.32's Qwen3.5 classes import the Qwen3-VL vision code, which needs
torchvision, and no CPU torchvision build for torch 2.13 is on the package registry (the CUDA build breaks every
vLLM model import on CPU: scripts/setup_vllm.sh), so the CPU build cannot start any Qwen3.5 / Qwen3.6 model. The
refusal applies to engines started or pushed to in this process (``launch``, ``serve``, ``push_weights`` with an
in-process engine); a push over a :func:`~parallm.integrations.vllm.connect` connection goes to an engine that is
already running the model, elsewhere, and is not refused.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os

DEEPSEEK_V4_REASON = (
    "DeepSeek-V4 is not supported by parallm's vLLM integration: vLLM 0.32's CPU build loads "
    "DeepseekV4ForCausalLM (head_dim 512 / index_head_dim 128 / a 64-channel RoPE only) but its first forward "
    "fails in the sparse sliding-window attention's metadata (vllm/v1/attention/ops/metadata.py, "
    "compute_token_to_req_indices launches a Triton kernel; the CPU build has no Triton CPU backend: "
    "\"TypeError: 'function' object is not subscriptable\"); pushes into GPU builds are untested and parallm exports "
    "transformers' tensor names, not the Hub names vLLM's V4 loader reads (docs/deepseek_v4.md)")

_REFUSED = {"deepseek_v4": DEEPSEEK_V4_REASON}
_ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV4Model": "deepseek_v4",
                  "MiniMaxM2ForCausalLM": "minimax_m2",
                  "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                  "Qwen3_5ForConditionalGeneration": "qwen3_5_vl",
                  "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_vl"}
MINIMAX_M2_CPU_REASON = (
    "MiniMax-M2 (minimax_m2) is not supported on vLLM's CPU build: vLLM 0.32 loads MiniMaxM2ForCausalLM but its "
    "first forward fails in the CPU router (vllm/model_executor/layers/fused_moe/router/cpu_router.py, "
    "_compute_routing: assert self.scoring_func == \"softmax\"; outside grouped top-k the CPU router takes "
    "softmax routing only, MiniMax-M2 routes with a sigmoid and a correction bias); start the engine on a GPU "
    "build and push over parallm.integrations.vllm.connect (docs/families.md)")
# families refused where this process's vLLM is the CPU build
_CPU_REFUSED = {"minimax_m2": MINIMAX_M2_CPU_REASON}
_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# families refused where this process's vLLM cannot import the model file vLLM runs them with
_NEEDS_IMPORT = {family: ("vllm.model_executor.models.qwen3_5", "Qwen3.5 / Qwen3.6")
                 for family in ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl")}


@functools.lru_cache(maxsize=None)
def _import_failure(module: str) -> str | None:
    """Why ``module`` cannot be imported here (``"ExceptionType: message"``), or None when it can or when vLLM
    itself is not installed (then nothing here runs an engine: the calls report that themselves)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason
        return f"{type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=None)
def _vllm_on_cpu() -> bool:
    """Whether the vLLM installed here is the CPU build (False where vLLM is not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform
    return bool(current_platform.is_cpu())


def import_reason(family: str) -> str | None:
    """The reason :func:`refuse_family` gives for ``family`` where this process's vLLM cannot run it, or None."""
    if family not in _NEEDS_IMPORT:
        return None
    module, label = _NEEDS_IMPORT[family]
    failure = _import_failure(module)
    if failure is None:
        return None
    cause = (" (vLLM 0.32's Qwen3.5 classes import the Qwen3-VL vision code, which needs torchvision; no CPU "
             "torchvision build for this torch is on the package registry)" if "torchvision" in failure else "")
    return (f"{label} ({family}) is not supported by the vLLM installed here: its model file {module} fails to "
            f"import ({failure}){cause}; start the engine where vLLM runs the architecture (a GPU build) and "
            "push over parallm.integrations.vllm.connect (docs/families.md)")


def refuse_family(family: str, what: str, *, local: bool = True) -> None:
    """ValueError (``what``: the call) for a family parallm's vLLM integration does not serve; ``local``: the
    engine runs (or is started) in this process, where a family whose vLLM model file cannot be imported here is
    refused too."""
    if family in _REFUSED:
        raise ValueError(f"{what}: {_REFUSED[family]}")
    reason = None
    if local:
        reason = _CPU_REFUSED.get(family) if _vllm_on_cpu() else None
        reason = reason or import_reason(family)
    if reason:
        raise ValueError(f"{what}: {reason}")


def refuse_checkpoint(model_dir, what: str) -> None:
    """:func:`refuse_family` for the family of the checkpoint directory ``model_dir`` (its config.json's
    ``model_type`` / ``architectures``; nothing when it has none: vLLM reports that itself)."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    model_type = config.get("model_type", "")
    refuse_family(_MODEL_TYPES.get(model_type, model_type), what)
    for arch in config.get("architectures") or ():
        refuse_family(_ARCHITECTURES.get(arch, ""), what)
