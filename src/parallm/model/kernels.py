"""The kernels a model chose at build, and their agreement across ranks.

Kernel choices depend on the device and the installed packages (``attn_impl="auto"``, the context-parallel block
kernel, the MoE experts' grouped GEMM, the Gated DeltaNet recurrence). Ranks that chose differently compute
different bits, and where a choice changes the communication (a kernel that needs other shapes) they can hang;
``build_model`` therefore compares every rank's choices once (:func:`agree_on_kernels`) and refuses a
difference on every rank, naming the rank and the choice.
"""

from __future__ import annotations

import os

import torch

from ..parallel.errors import gather_objects

# A module attribute holding a kernel choice: a string, or an object with a ``name`` (AttnBackend, BlockKernel,
# the Gated DeltaNet kernel).
KERNEL_ATTRIBUTES = ("backend", "cp_block", "kernel")


def kernel_choices(chunks) -> dict[str, str]:
    """``{"<module class>.<attribute>": "<kernel name(s)>"}`` over every module of ``chunks`` (names of one key
    joined in sorted order). Only a module's own attributes count (``module.__dict__``), not submodules."""
    found: dict[str, set[str]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for attr in KERNEL_ATTRIBUTES:
                value = module.__dict__.get(attr)
                name = value if isinstance(value, str) else getattr(value, "name", None)
                if isinstance(name, str):
                    found.setdefault(f"{type(module).__name__}.{attr}", set()).add(name)
    return {key: ", ".join(sorted(names)) for key, names in sorted(found.items())}


def kernel_mismatch(choices: list[dict[str, str]]) -> str | None:
    """What differs between ranks' :func:`kernel_choices` (indexed by global rank), or None. Ranks compare only
    the keys both hold (pipeline stages hold different layer kinds)."""
    first: dict[str, tuple[int, str]] = {}
    for rank, mine in enumerate(choices):
        for key, name in mine.items():
            if key not in first:
                first[key] = (rank, name)
            elif first[key][1] != name:
                other, theirs = first[key]
                return (f"rank {rank} chose {key} = {name!r}, rank {other} chose {theirs!r}: every rank must run "
                        "the same kernels (pass the kernel explicitly, e.g. build_model(attn_impl=...) or "
                        "PARALLM_MOE_EXPERTS=..., or give every rank the same device kind and packages)")
    return None


def agree_on_kernels(chunks, *, what: str = "build_model") -> dict[str, str]:
    """Collective over the world (one all-gather of each rank's :func:`kernel_choices`): a ValueError on every
    rank when two ranks chose differently (:func:`kernel_mismatch`). Returns this rank's choices."""
    mine = kernel_choices(chunks)
    problem = kernel_mismatch(gather_objects(mine, what=what))
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    return mine


def choose_kernel(kernels: dict, name: str | None, *, env: str, fast: str, what: str, device, dtype):
    """A recurrent layer kind's kernel from its registry ``kernels`` (each entry with ``unavailable(device,
    dtype)``): ``name``, default ``$env``, else "auto": ``fast`` where it can run on a bf16 / fp16 model (the GPU
    kernels' Triton / CUDA dots run fp32 inputs at TF32, about 1e-3 relative, which an fp32 model does not ask
    for; naming ``fast`` still runs it on fp32), else "torch". A named kernel that cannot run here is a ValueError
    saying why."""
    name = name or os.environ.get(env, "auto")
    if name == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        return kernels[fast] if half and kernels[fast].unavailable(device, dtype) is None else kernels["torch"]
    if name not in kernels:
        raise ValueError(f"{env} must be 'auto' or one of {sorted(kernels)}, got {name!r}")
    why = kernels[name].unavailable(device, dtype)
    if why is not None:
        raise ValueError(f"the {what} kernel {name!r} cannot run here: {why}")
    return kernels[name]
