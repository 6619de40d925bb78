"""Each rank's share of the HF tensors, element by element: the unit of a sparse (delta) weight sync.

A sparse sync (verl's ``delta_sharded`` checkpoint engine) keeps a snapshot of what every rank last sent, diffs
the rank's *local* shard against it, and ships only the changed elements, addressed in the HF tensors'
coordinates. :func:`hf_shard_map` says, for every tensor group the export stream carries (one weight-table entry:
a parameter, or one routed expert's slab of a stacked expert parameter), which rank contributes which of its
elements and where each lands in the HF tensors:

* each element of the unsharded model is contributed by exactly one rank: of the ranks holding a TP rank's
  shard (data-parallel, context-parallel and, for dense tensors, expert-parallel replicas), the one with the
  lowest data-parallel rank (then global rank) -- the export stream's choice of sender; within that shard only
  its primary slices (:func:`parallm.checkpoint.global_view.global_slices`: a replicated tensor counts on TP
  rank 0 only, a KV head replicated over TP ranks on its first holder), never the vocabulary padding rows;
* every rank lists every entry in the same (global, stream) order, contributing or not (pipeline stages, expert
  ranks and replicas that hold none of it list it with no tensor), so that collectives over the list keep in
  step on every rank;
* :meth:`HFShard.hf_positions` turns flat positions in the contributing rank's tensor into
  ``(slot, flat position in that HF tensor)``, by index arithmetic on the positions asked for (no per-element
  map is stored).

The map is built once per model (one exchange over the world) and holds no tensors: :meth:`HFShard.tensor`
reads the parameter each time, so offloading and reloading the model do not invalidate it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.table import entry_tensor, expected_hf_shapes, held_params, model_entries, row_dtype
from ..parallel.errors import exchange_rows
from ..parallel.state import as_chunks, dims_of, require_initialized
from .export_plan import saved_entries
from .global_view import global_slices

__all__ = ["HFShard", "Piece", "hf_shard_map"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` along ``dim`` of the contributing rank's tensor are HF tensor ``slot``'s
    elements ``[offset, offset + stop - start)`` along the same dim (every other dim whole on both sides)."""
    slot: int
    dim: int
    start: int
    stop: int
    offset: int


@dataclass
class HFShard:
    """One weight-table entry as the sparse sync sees it on this rank. ``key``: the entry's HF names joined by
    ``+`` (the same on every rank); ``slots``: ``(HF name, full shape)`` of each HF tensor the entry makes;
    ``pieces``: what this rank contributes (empty: nothing; then :meth:`tensor` is None); ``dtype``: the
    parameter's dtype on every rank (the model's, float32 for a ``keep_fp32`` row)."""
    key: str
    slots: tuple[tuple[str, tuple[int, ...]], ...]
    pieces: tuple[Piece, ...]
    dtype: torch.dtype
    shape: tuple[int, ...] = ()     # the contributing rank's tensor's shape
    _chunk: object = None
    _entry: object = None

    @property
    def contributes(self) -> bool:
        return bool(self.pieces)

    def tensor(self) -> torch.Tensor | None:
        """The contributing rank's tensor (:func:`parallm.model.table.entry_tensor`: the parameter, or the
        expert's slab of its stacked parameter), detached, read now; None on other ranks."""
        return entry_tensor(self._chunk, self._entry).detach() if self.pieces else None

    def hf_positions(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, position)`` (int64 each) of flat positions ``local`` in this rank's tensor: the HF tensor
        each lands in and the flat position there; slot -1 for an element this rank does not contribute (a
        replica's, a vocabulary padding row)."""
        local = local.to(torch.int64)
        slot = torch.full_like(local, -1)
        pos = torch.zeros_like(local)
        if not local.numel() or not self.pieces:
            return slot, pos
        coords = list(torch.unravel_index(local, self.shape)) if self.shape else []
        for p in self.pieces:
            along = coords[p.dim]
            inside = (along >= p.start) & (along < p.stop)
            if not bool(inside.any()):
                continue
            hf_shape = self.slots[p.slot][1]
            flat = torch.zeros_like(local)
            stride = 1
            for d in range(len(hf_shape) - 1, -1, -1):
                c = coords[d] - p.start + p.offset if d == p.dim else coords[d]
                flat += c * stride
                stride *= hf_shape[d]
            slot = torch.where(inside, p.slot, slot)
            pos = torch.where(inside, flat, pos)
        return slot, pos


def hf_shard_map(chunks, *, what: str = "hf_shard_map") -> list[HFShard]:
    """Every exported entry of the model, in the export stream's order, with this rank's contribution (module
    docstring). Collective over the world: every rank calls it."""
    require_initialized(what)
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec, task = chunks[0].spec, chunks[0].task
    mine, everything = model_entries(chunks, layout)
    holds, _ = held_params(mine, everything)
    rows = exchange_rows([layout.tp_rank, layout.dp_rank] + holds, what=what)
    tp_of, dp_of, held = rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2:].tolist()
    shapes = expected_hf_shapes(chunks[0].table, spec, task=task, pp=layout.pp)
    where = {(e.row, e.layer): (e, chunk) for e, chunk in mine}
    model_dtype = chunks[0].config.params_dtype
    out = []
    for i, entry in saved_entries(everything):
        slots = tuple((name, tuple(shapes[name])) for name in entry.hf)
        dtype = row_dtype(entry.row, model_dtype)
        pieces: tuple[Piece, ...] = ()
        if held[layout.rank][i]:
            holders = [r for r in range(layout.world) if held[r][i] and tp_of[r] == layout.tp_rank]
            src = min(holders, key=lambda r: (dp_of[r], r))
            local_entry, chunk = where[(entry.row, entry.layer)]
            param = chunk.get_parameter(local_entry.local)
            if param.dtype != dtype:
                raise RuntimeError(f"internal error: {local_entry.local} is {param.dtype}, its row says {dtype}")
            if src == layout.rank:
                slot_of = {name: k for k, name in enumerate(entry.hf)}
                pieces = tuple(Piece(slot_of[s.name], s.dim, s.start, s.stop, s.offsets[s.dim])
                               for s in global_slices(local_entry, param, layout, shapes) if s.primary)
            shape = tuple(entry_tensor(chunk, local_entry).shape)
            out.append(HFShard("+".join(entry.hf), slots, pieces, dtype, shape, chunk, local_entry))
        else:
            out.append(HFShard("+".join(entry.hf), slots, pieces, dtype))
    return out
