"""Dtype conversion of weights on their way in or out (load, save, export): one pass, checked only where a cast
can overflow.

Rules, the same for every path (``load_hf_weights`` in both modes and from state dicts, ``save_hf_weights(dtype=)``,
``export_hf_tensors(dtype=)``):

* A cast can overflow only when the target's largest finite value is below the source's (``finfo``): into
  float16 from bfloat16 / float32 / float64, into bfloat16 from float32 (the top 0.2% of float32's range rounds
  to inf in bfloat16) or float64, into float32 from float64. Widening casts (bf16 -> fp32, fp16 -> fp32,
  fp16 -> bf16, anything -> fp64) are never checked: they cannot overflow.
* The check reads the *source* values once (``aminmax``, no temporary the size of the tensor) and casts the two
  extremes with torch's own conversion, so it agrees with the copy bit for bit (round to nearest even: into
  float16, 65519.99 stays finite and 65520 becomes inf). A finite value that would become inf is a
  :class:`CheckpointError` naming the tensor, the largest magnitude and the target's max.
* inf and NaN already present in the source are not an error, for any dtype: they are copied as they are (as a
  same-dtype load copies them, and as transformers loads them). Only values the conversion itself would destroy
  are refused. Checking for them would cost a full extra pass over every tensor, including same-dtype loads.
* The conversion happens inside the copy into its destination (``dst.copy_(src)`` converts while copying), never
  through a converted temporary.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..model.table import entry_tensor

# The floating dtypes weights travel in between ranks; a dtype's index here is its code in a status word.
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# what the loader's broadcast may carry: the floating wire dtypes and int64 (an ``integer`` row: DeepSeek-V4's tid2eid)
LOAD_WIRE_DTYPES = WIRE_DTYPES + (torch.int64,)

# What to suggest instead of a dtype that overflowed.
_WIDER = {torch.float16: "bfloat16 or float32", torch.bfloat16: "float32", torch.float32: "float64"}


def can_overflow(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` values to ``dst`` can turn a finite value into inf."""
    if not (src.is_floating_point and dst.is_floating_point) or src == dst:
        return False
    return torch.finfo(src).max > torch.finfo(dst).max


def _finite_extremes(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(min, max) over the finite values of ``src`` (None when it has none). One read-only pass unless the
    tensor holds inf / NaN (then a second pass over its finite values)."""
    if src.numel() == 0:
        return None
    lo, hi = torch.aminmax(src)
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        finite = src[torch.isfinite(src)]
        if finite.numel() == 0:
            return None
        lo, hi = torch.aminmax(finite)
    return lo, hi


def check_cast(src: torch.Tensor, dtype: torch.dtype, names, *, instead: str = "build the model") -> None:
    """Raise :class:`CheckpointError` if a finite value of ``src`` becomes inf in ``dtype``; free when the cast
    cannot overflow. ``names``: the HF tensor name(s) for the message; ``instead``: what the user should do in a
    wider dtype ("build the model", "save", "export")."""
    if not can_overflow(src.dtype, dtype):
        return
    extremes = _finite_extremes(src)
    if extremes is None:
        return
    lo, hi = extremes
    if torch.isfinite(lo.to(dtype)) and torch.isfinite(hi.to(dtype)):
        return
    biggest = max(abs(lo.item()), abs(hi.item()))
    names = [names] if isinstance(names, str) else list(names)
    raise CheckpointError(f"{', '.join(names)}: values up to {biggest:.6g} overflow {dtype} (max "
                          f"{torch.finfo(dtype).max:.6g}); {instead} in {_WIDER.get(dtype, 'a wider dtype')}")


def check_entry_casts(mine, dtype: torch.dtype, *, instead: str) -> None:
    """:func:`check_cast` of every saved parameter among ``mine`` (``(table entry, chunk)`` pairs): run before
    any collective of a save or an export, so that an overflow is an error on every rank."""
    for e, chunk in mine:
        if e.row.save:
            check_cast(entry_tensor(chunk, e).detach(), dtype, e.hf, instead=instead)


def copy_cast_(dst: torch.Tensor, src: torch.Tensor, names, *, instead: str = "build the model") -> None:
    """``dst.copy_(src)`` converting to ``dst.dtype`` in the same pass, after :func:`check_cast`. Integer / bool
    sources for a floating-point destination are refused (their bits are not weights)."""
    if dst.dtype.is_floating_point != src.dtype.is_floating_point:
        names = [names] if isinstance(names, str) else list(names)
        raise CheckpointError(f"{', '.join(names)}: checkpoint dtype {src.dtype} is not a "
                              f"{'floating-point' if dst.dtype.is_floating_point else 'n integer'} type (the model "
                              f"parameter is {dst.dtype})")
    check_cast(src, dst.dtype, names, instead=instead)
    dst.copy_(src)


def cast(src: torch.Tensor, dtype: torch.dtype | None, names, *, instead: str, device=None) -> torch.Tensor:
    """``src`` in ``dtype`` (None: unchanged) on ``device`` (None: unchanged), checked by :func:`check_cast`;
    ``src`` itself when nothing changes, else one converting copy."""
    dtype = dtype or src.dtype
    device = torch.device(device) if device is not None else src.device
    if dtype == src.dtype and device == src.device:
        return src
    check_cast(src, dtype, names, instead=instead)
    return src.to(device=device, dtype=dtype)
