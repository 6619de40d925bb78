"""The one accommodation that lets megatron-core's sequence-parallel code run on CPU.

megatron-core allocates the buffers of its sequence-parallel all-gather / reduce-scatter (mappings.py,
layers.py, utils.GlobalMemoryBuffer) with ``device=torch.cuda.current_device()``. In a process without a usable
GPU that call raises ("Torch not compiled with CUDA enabled" / "no CUDA GPUs are available"). When a
sequence-parallel model is built with CPU parameters, parallm replaces ``torch.cuda.current_device`` for the rest
of the process with a function that answers ``"cpu"``, so those buffers are CPU tensors and the collectives run
on gloo (all_gather_into_tensor / reduce_scatter_tensor).

What it changes for other code in the process, precisely: it is installed only when
``torch.cuda.is_available()`` is False, so every call it answers is one that would otherwise have raised;
nothing that worked before behaves differently. A process that sees a GPU is never patched: a CPU
sequence-parallel model there is refused (megatron-core would put its buffers on the GPU) with a message saying
to hide the GPUs (``CUDA_VISIBLE_DEVICES=``) or to build on GPU with NCCL. A model built on GPU changes nothing.
"""

from __future__ import annotations

import torch


def _cpu_current_device():
    return "cpu"


def enable_megatron_sequence_parallel_on_cpu() -> None:
    """Install the accommodation (idempotent), or raise ValueError in a process that sees a GPU."""
    if torch.cuda.current_device is _cpu_current_device:
        return
    if torch.cuda.is_available():
        raise ValueError("sequence_parallel=True with CPU parameters in a process that sees a GPU: megatron-core "
                         "would allocate its sequence-parallel buffers on the GPU. Build on GPU (nccl backend), "
                         "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU")
    torch.cuda.current_device = _cpu_current_device
