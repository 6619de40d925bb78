"""The one accommodation that lets megatron-core's sequence-parallel code run on a CPU-only PyTorch build.

megatron-core allocates the buffers of its sequence-parallel all-gather / reduce-scatter (mappings.py,
layers.py, utils.GlobalMemoryBuffer) with ``device=torch.cuda.current_device()``. On a CPU-only build that call
raises "Torch not compiled with CUDA enabled" (and with a GPU present but the model on CPU under gloo, the buffers
would land on the GPU). When a sequence-parallel model is built with its parameters on the CPU, parallm makes
``torch.cuda.current_device()`` answer ``"cpu"`` for the rest of the process, so those buffers are CPU tensors and
the collectives run on gloo (all_gather_into_tensor / reduce_scatter_tensor). A model built on GPU (NCCL) changes
nothing.
"""

from __future__ import annotations

import torch


def _cpu_current_device():
    return "cpu"


def enable_megatron_sequence_parallel_on_cpu() -> bool:
    """Install the accommodation (idempotent); returns True."""
    if torch.cuda.current_device is not _cpu_current_device:
        torch.cuda.current_device = _cpu_current_device
    return True
