"""Importing megatron-core without its start-up warning.

megatron-core warns at import time that Transformer Engine and Apex are not installed; parallm uses neither (its
layers are megatron-core's local tensor-parallel ones), so the warning only misleads. Every parallm module that
imports megatron-core calls :func:`import_megatron` first: the first import happens here, with that one warning
filtered, and later imports are silent anyway.
"""

from __future__ import annotations

import warnings

TE_APEX_WARNING = ".*Transformer Engine and Apex are not installed.*"


def import_megatron():
    """Import (once) and return ``megatron.core`` with the Transformer Engine / Apex warning silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TE_APEX_WARNING)
        import megatron.core
        from megatron.core import parallel_state, tensor_parallel  # noqa: F401 - the modules that warn
    return megatron.core


CUDA_HINT = ".*CUDA_DEVICE_MAX_CONNECTIONS.*"


def silence_cuda_hints() -> None:
    """megatron-core's tensor-parallel linears advise, once per process, setting CUDA_DEVICE_MAX_CONNECTIONS=1
    (a CUDA stream setting: meaningless without a CUDA device). :func:`parallm.init_parallel` calls this when
    its groups compute on the CPU. It sets the flag megatron-core keeps for "already warned"
    (``linear_with_grad_accumulation_and_async_allreduce.warned``), so that hint alone is silenced and no
    warning filter changes; where that flag does not exist, a filter for the hint's message from megatron's
    modules instead."""
    import importlib
    import_megatron()
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    fn = getattr(layers, "linear_with_grad_accumulation_and_async_allreduce", None)
    if fn is not None and hasattr(fn, "warned"):
        fn.warned = True
    else:
        warnings.filterwarnings("ignore", message=CUDA_HINT, category=UserWarning, module="megatron")


def ignore_library_warnings() -> None:
    """Process-wide, for programs whose output is a report (the command line's ranks): the import warning above,
    the CUDA_DEVICE_MAX_CONNECTIONS hint (which :func:`silence_cuda_hints` already silences on CPU), and the
    torch.distributed deprecation notices (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` renamed in
    torch 2.13) that megatron-core's own calls raise; parallm's own collectives use the new names
    (:func:`parallm.parallel.comm.all_gather_single`) and raise none."""
    warnings.filterwarnings("ignore", message=TE_APEX_WARNING)
    warnings.filterwarnings("ignore", message=CUDA_HINT)
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*deprecated.*")
