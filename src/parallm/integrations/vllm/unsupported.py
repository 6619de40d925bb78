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
"""

from __future__ import annotations

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
_ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV4Model": "deepseek_v4"}


def refuse_family(family: str, what: str) -> None:
    """ValueError (``what``: the call) for a family parallm's vLLM integration does not serve."""
    if family in _REFUSED:
        raise ValueError(f"{what}: {_REFUSED[family]}")


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
    refuse_family(config.get("model_type", ""), what)
    for arch in config.get("architectures") or ():
        refuse_family(_ARCHITECTURES.get(arch, ""), what)
