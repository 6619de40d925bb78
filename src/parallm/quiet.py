"""Warnings from megatron-core and torch.distributed that tell parallm's users nothing, named in one place."""

from __future__ import annotations

import contextlib
import warnings

# megatron-core warns on import that Transformer Engine / Apex are absent: parallm uses neither.
MEGATRON_IMPORT = ".*Transformer Engine and Apex are not installed.*"
# megatron-core's sequence-parallel / pipeline calls: a GPU tuning hint, repeated on every call.
MEGATRON_CALLS = ".*CUDA_DEVICE_MAX_CONNECTIONS.*"
# torch.distributed deprecation notices triggered inside megatron-core, not by the caller.
TORCH_DEPRECATIONS = ".*torch.distributed.*deprecated.*"


@contextlib.contextmanager
def megatron_import():
    """``with megatron_import(): from megatron.core import ...`` without the Transformer Engine / Apex notice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MEGATRON_IMPORT)
        yield


def ignore_library_warnings() -> None:
    """Process-wide, for programs whose output is a report (the command line, verification ranks)."""
    warnings.filterwarnings("ignore", message=MEGATRON_IMPORT)
    warnings.filterwarnings("ignore", message=MEGATRON_CALLS)
    warnings.filterwarnings("ignore", category=FutureWarning, message=TORCH_DEPRECATIONS)
