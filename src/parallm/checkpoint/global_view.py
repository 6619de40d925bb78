"""Each local parameter as slices of the unsharded (HF-layout) tensors: the global identity a training checkpoint
stores tensors under, so that it loads at any other layout.

:func:`global_slices` is the one place that maps a local parameter to global slices. It reads the parameter's
placement (``param.parallm_placement``, :mod:`parallm.model.placement`) and its weight-table entry (HF names):
for TP layouts the layout kind's ``blocks`` say which rows / columns of which HF tensor make up this rank's
shard. A routed expert's entry names one slab of its layer's stacked expert parameter (``entry.index`` along
dim 0); its slices are those of the per-expert layout within that slab, so each expert is stored under its own
Hub names whatever the layout (and checkpoints written when every expert was a parameter of its own read the
same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.placement import placement_of


@dataclass(frozen=True)
class GlobalSlice:
    """Rows / columns ``[start, stop)`` along ``dim`` of the local parameter are the slice of HF tensor ``name``
    (full shape ``shape``) that starts at ``offsets`` and has the same sizes. ``primary``: this rank is the
    one writer of that slice (replicas elsewhere, over TP or data parallelism, hold the same values). ``index``:
    for a routed expert, its slab ``[index]`` of the stacked parameter, which ``dim`` / ``start`` / ``stop``
    refer to (None: the parameter itself)."""
    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dim: int
    start: int
    stop: int
    primary: bool
    index: int | None = None

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of ``tensor`` (the parameter, or any state tensor shaped like it) that this slice covers."""
        if self.index is not None:
            tensor = tensor[self.index]
        if tensor.dim() == 0:                      # a 0-d tensor: the one slice is all of it
            return tensor
        return tensor.narrow(self.dim, self.start, self.stop - self.start)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(self.shape))


def global_slices(entry, param: torch.Tensor, dims, hf_shapes: dict[str, tuple[int, ...]]) -> list[GlobalSlice]:
    """The pieces of ``param`` (weight-table ``entry``, this rank's coordinates ``dims``) as slices of the HF
    tensors (full shapes ``hf_shapes``). Vocabulary padding rows belong to no slice."""
    layout = placement_of(param).layout
    if entry.index is not None:
        layout = layout.inner
    shapes = [tuple(hf_shapes[n]) for n in entry.hf]
    out = []
    for src, dim, a, b, la, lb, primary in layout.blocks(dims.tp_rank, dims.tp, shapes):
        shape = shapes[src]
        offsets = tuple(a if d == dim else 0 for d in range(len(shape)))
        piece = GlobalSlice(entry.hf[src], shape, offsets, dim, la, lb, bool(primary), entry.index)
        if tuple(piece.local(param).shape) != piece.sizes:
            raise RuntimeError(f"internal error: {entry.local} slice {la}:{lb} along dim {dim} has shape "
                               f"{tuple(piece.local(param).shape)}, its slice of {piece.name} {piece.sizes}")
        out.append(piece)
    return out


def uncovered_rows(param: torch.Tensor, slices: list[GlobalSlice]) -> int:
    """Rows at the end of ``param`` that no slice covers (vocabulary padding): they hold zeros."""
    if any(s.index is not None for s in slices):
        return 0      # a stacked expert's slab: covered whole
    rows = [s.stop for s in slices if s.dim == 0]
    covered = max(rows) if rows else (param.shape[0] if param.dim() and slices else 0)
    return param.shape[0] - covered if param.dim() else 0
