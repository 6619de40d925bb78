"""The one accommodation that lets megatron-core's sequence-parallel code run on a CPU-only PyTorch build.

megatron-core allocates the buffers of its sequence-parallel all-gather / reduce-scatter (mappings.py,
layers.py, utils.GlobalMemoryBuffer) with ``device=torch.cuda.current_device()``. On a CPU-only build that call
raises "Torch not compiled with CUDA enabled". When (and only when) CUDA is unavailable, parallm makes
``torch.cuda.current_device()`` answer ``"cpu"``, so those buffers are CPU tensors and the collectives run on
gloo (all_gather_into_tensor / reduce_scatter_tensor, both supported by gloo in torch >= 2.x). With CUDA
available nothing is changed.
"""

from __future__ import annotations

import torch


def _cpu_current_device():
    return "cpu"


def enable_megatron_sequence_parallel_on_cpu() -> bool:
    """Install the accommodation if needed; returns True when it is active."""
    if torch.cuda.is_available():
        return False
    if torch.cuda.current_device is not _cpu_current_device:
        torch.cuda.current_device = _cpu_current_device
    return True
