"""Which kernel runs a mixture-of-experts block's expert GEMMs: ``torch._grouped_mm`` where it runs correctly on
the device and dtype (probed once where that is in doubt), else a loop over the experts; ``PARALLM_MOE_EXPERTS``
asks for one. Used by :mod:`parallm.model.layers.moe` (which re-exports these names)."""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from ...parallel.state import as_device

logger = logging.getLogger("parallm")

KERNELS = ("grouped_mm", "loop")
KERNEL_ENV = "PARALLM_MOE_EXPERTS"     # "auto" (default), "grouped_mm" or "loop"
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_support(device, dtype: torch.dtype, sizes) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the experts here (None: it can). ``sizes``: the GEMMs' inner and outer
    dimensions (hidden, 2 I / tp, I / tp). What it requires: torch >= 2.8 on CPU (a C++ loop of ``mm`` per group,
    the same bits as a Python loop), fp32 / bf16 / fp16, 16-byte aligned rows (every size a multiple of 16 bytes);
    on CUDA bf16 on compute capability >= 9.0, where torch has a grouped kernel (elsewhere it falls back to a
    per-group loop that reads the group offsets on the host: a device sync per call)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in _GROUPED_DTYPES:
        return f"torch._grouped_mm takes {', '.join(str(d) for d in _GROUPED_DTYPES)}, not {dtype}"
    itemsize = torch.empty((), dtype=dtype).element_size()
    odd = [n for n in sizes if (n * itemsize) % 16]
    if odd:
        return f"sizes {odd} x {itemsize} B are not multiples of 16 bytes (torch._grouped_mm's row alignment)"
    device = as_device(device)
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"on CUDA torch._grouped_mm has a grouped kernel for bfloat16 only, not {dtype}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] < 9:
            return "torch._grouped_mm has no grouped kernel below compute capability 9.0"
        return None
    return f"torch._grouped_mm is not used on {device.type} devices"


def expert_kernel(device_type: str, dtype: torch.dtype, sizes: tuple[int, ...]) -> str:
    """``"grouped_mm"`` or ``"loop"`` for experts of these GEMM sizes in ``dtype`` on a ``device_type`` device:
    grouped where :func:`grouped_mm_support` allows it, unless env ``PARALLM_MOE_EXPERTS`` says ``loop`` (or
    ``grouped_mm``, which then must be supported). Chosen once per process and argument set, and logged."""
    return _choose_kernel(device_type, dtype, tuple(sizes), os.environ.get(KERNEL_ENV, "auto").strip().lower()
                          or "auto")


@functools.cache
def _choose_kernel(device_type: str, dtype: torch.dtype, sizes: tuple[int, ...], wanted: str) -> str:
    if wanted not in KERNELS + ("auto",):
        raise ValueError(f"{KERNEL_ENV}={wanted!r}: use auto, grouped_mm or loop")
    problem = grouped_mm_support(device_type, dtype, sizes)
    if wanted == "grouped_mm" and problem:
        raise ValueError(f"{KERNEL_ENV}=grouped_mm, but {problem}")
    if problem is None and wanted != "loop" and device_type in PROBED_DEVICE_TYPES:
        problem = empty_group_problem(device_type, dtype)
        if problem is not None:
            if wanted == "grouped_mm":
                raise ValueError(f"{KERNEL_ENV}=grouped_mm, but {problem}")
            logger.warning("parallm: torch._grouped_mm fails its check on this %s device (%s); the MoE experts "
                           "compute with a loop over the experts instead", device_type, problem)
    kernel = "loop" if wanted == "loop" or problem else "grouped_mm"
    why = f"{KERNEL_ENV}={wanted}" if wanted != "auto" else (problem or "supported here")
    logger.info("parallm: MoE experts (%s on %s) compute with %s (%s)", str(dtype).replace("torch.", ""),
                device_type, "torch._grouped_mm" if kernel == "grouped_mm" else "a loop over the experts", why)
    return kernel


# Device types on which the grouped kernel is checked once before it is used (:func:`empty_group_problem`): a
# PyTorch issue reports non-zero gradients for empty groups from torch._grouped_mm on SM100 GPUs. The CPU's
# grouped_mm is a loop of mm per group (an empty group computes nothing), so it is not checked.
PROBED_DEVICE_TYPES = ("cuda",)


def _gated_silu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate; up]`` (the probe's activation, the same on both of its sides)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def empty_group_problem(device, dtype: torch.dtype) -> str | None:
    """Run the experts' two grouped GEMMs as :class:`Experts` does, forward and backward, on a few rows split
    over three local experts of which the middle one gets none, on ``device`` in ``dtype``; return what is wrong
    (None: nothing): the empty expert's weight gradients must be exactly zero, and the outputs and gradients
    must equal a loop of ``F.linear`` over the experts (to the dtype's rounding: the kernels may accumulate in
    another order). A few small kernels, once per process and kernel choice (:func:`expert_kernel` caches)."""
    device = as_device(device)
    g = torch.Generator().manual_seed(0)
    hidden, width, counts = 16, 16, [5, 0, 3]
    rows = torch.randn(sum(counts), hidden, generator=g).to(device=device, dtype=dtype)
    w1 = torch.randn(3, 2 * width, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w2 = torch.randn(3, hidden, width, generator=g).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(sum(counts), hidden, generator=g).to(device=device, dtype=dtype)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    with torch.enable_grad():       # build_model may run under no_grad
        out = torch._grouped_mm(_gated_silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets)),
                                w2.transpose(-2, -1), offs=offsets)
        d1, d2 = torch.autograd.grad(out, (w1, w2), grad)
        ref = torch.cat([F.linear(_gated_silu(F.linear(part, a)), b)
                         for part, a, b in zip(rows.split(counts), w1.unbind(0), w2.unbind(0))])
        r1, r2 = torch.autograd.grad(ref, (w1, w2), grad)
    if d1[1].count_nonzero() or d2[1].count_nonzero():
        return (f"an expert that no token chose got a non-zero weight gradient from torch._grouped_mm "
                f"(max {max(d1[1].abs().max().item(), d2[1].abs().max().item()):.3g})")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, want in (("output", out, ref), ("fc1 gradient", d1, r1), ("fc2 gradient", d2, r2)):
        if not torch.allclose(got.float(), want.float(), **tol):
            return (f"torch._grouped_mm's {name} differs from a loop over the experts by "
                    f"{(got.float() - want.float()).abs().max().item():.3g}")
    return None
