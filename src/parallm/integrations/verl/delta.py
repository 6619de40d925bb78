"""The engine's shard and delta exports: verl 0.9.1's ``get_per_tensor_param_shard`` /
``get_per_tensor_param_delta_shard`` contract (``verl.workers.engine.spec``), which verl's ``delta_sharded``
checkpoint engine consumes (a sparse weight sync: after a full seed sync, only the elements that changed).

parallm's side is :func:`parallm.checkpoint.shards.hf_shard_map`: every exported tensor group (one weight-table
entry: a fused QKV, a gate/up pair, an expert's slab, a norm) in the export stream's order on every rank, and for
each element of the model the one rank that contributes it (the export stream's sender of that TP shard, primary
slices only) and its place in the HF tensors. Here:

* ``shard_stream`` (``get_per_tensor_param_shard``) yields ``(key, local_flat, ShardSpec)`` per entry: the
  contributing rank's parameter (or expert slab) flattened, in the parameter's own dtype (not cast: a float32
  model's deltas are float32, what the seed sync sent), every other rank an empty tensor of that dtype, so the
  sequence -- and the dtype of every entry -- is the same on every rank. The spec is an explicit override
  (``place=0``, ``contributes``, the world group as ``gather_group``): a parallm parameter is not a DTensor, and
  with pipeline stages and expert ranks the contributors of one entry are not one DTensor mesh dim.
* ``delta_entry`` is the per-entry builder verl's ``hf_delta_export`` calls with the shard-local positions that
  changed since the snapshot (verl diffs bytes against its snapshot): it maps them to HF coordinates with
  :meth:`HFShard.hf_positions` and returns verl's ``(slots, dtype_str, counts, hf_idx, hf_val)``, per-slot
  pieces in slot order, int32 positions within each HF tensor. Elements a rank holds but does not contribute (a
  replica's, vocabulary padding rows) are dropped.

The gather group is the world (verl's gather sends each entry's pieces to the group's rank 0, which must be the
sender, global rank 0); with one rank there is nothing to gather (``None``, verl's "already global").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl.workers.engine.spec import ShardSpec

from parallm.checkpoint.shards import hf_shard_map

__all__ = ["ShardExport"]

INT32_MAX = 2 ** 31 - 1


class ShardExport:
    """The shard map of one engine's model (built on first use, collectively) and the two exports over it."""

    def __init__(self, chunks):
        self.shards = hf_shard_map(chunks, what="get_per_tensor_param_shard")
        self.by_key = {s.key: s for s in self.shards}
        self.device = next(chunks[0].parameters()).device
        self.group = dist.group.WORLD if dist.get_world_size() > 1 else None
        for s in self.shards:
            for name, shape in s.slots:
                if torch.Size(shape).numel() > INT32_MAX:
                    raise NotImplementedError(f"delta export: {name} has {torch.Size(shape).numel()} elements; "
                                              "verl's delta wire addresses positions in int32")

    def shard_stream(self):
        """``(key, local flat tensor, ShardSpec)`` per entry, in the same order on every rank."""
        for s in self.shards:
            t = s.tensor()
            if t is None:
                local = torch.empty(0, dtype=s.dtype, device=self.device)
            else:
                if t.dtype != s.dtype:
                    raise RuntimeError(f"delta export: {s.key} is {t.dtype} here, {s.dtype} in the shard map")
                local = t.reshape(-1)
            numel = sum(torch.Size(shape).numel() for _, shape in s.slots)
            yield s.key, local, ShardSpec(full_shape=(numel,), place=0, gather_group=self.group,
                                          contributes=s.contributes)

    def delta_entry(self, name, spec, place, lidx, lval):
        """verl's per-entry hook (``hf_delta_export``'s ``entry_fn``): the changed elements of this rank's shard
        ``lidx`` (flat positions) / ``lval`` as per-HF-tensor pieces."""
        s = self.by_key[name]
        k = len(s.slots)
        dtype_str = str(s.dtype).replace("torch.", "")
        if not lidx.numel():
            return (list(s.slots), dtype_str, torch.zeros(k, dtype=torch.int64),
                    torch.empty(0, dtype=torch.int32, device=lval.device), lval.new_empty(0))
        slot, pos = s.hf_positions(lidx.cpu())
        keep = slot >= 0
        slot, pos = slot[keep], pos[keep]
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot, minlength=k).to(torch.int64)
        vals = lval[keep.to(lval.device)][order.to(lval.device)]
        return list(s.slots), dtype_str, counts, pos[order].to(torch.int32).to(lval.device), vals
