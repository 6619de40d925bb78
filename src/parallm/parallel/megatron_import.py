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


def ignore_library_warnings() -> None:
    """Process-wide, for programs whose output is a report (the command line's ranks): the warning above, the
    CUDA_DEVICE_MAX_CONNECTIONS hint megatron-core's sequence-parallel / pipeline code repeats on every call, and
    the torch.distributed deprecation notices raised inside megatron-core, not by the caller."""
    warnings.filterwarnings("ignore", message=TE_APEX_WARNING)
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*deprecated.*")
