"""The engine's shard and delta exports: verl 0.9.1's ``get_per_tensor_param_shard`` /
``get_per_tensor_param_delta_shard`` contract (``verl.workers.engine.spec``), which verl's ``delta_sharded``
checkpoint engine consumes (a sparse weight sync: after a full seed sync, only the elements that changed).

parallm's side is :func:`parallm.checkpoint.shards.hf_shard_map`: every exported tensor group (one weight-table
entry: a fused QKV, a gate/up pair, an expert's slab, a norm) in the export stream's order on every rank, and for
each element of the model the one rank that contributes it (the export stream's sender of that TP shard, primary
slices only) and its place in the HF tensors. Here:

* ``shard_stream`` (``get_per_tensor_param_shard``) yields ``(key, local_flat, ShardSpec)`` per entry: the
  contributing rank's parameter (or expert slab) flattened and cast to the rollout's dtype, :data:`ROLLOUT_DTYPE`
  (bfloat16: what verl 0.9.1's FSDP and Megatron engines cast every floating shard to, what its seed sync casts
  the full export to, ``rollout_dtype``'s default, and the only dtype its vLLM delta receiver accepts); every
  other rank an empty tensor of that dtype, so the sequence -- and the dtype of every entry -- is the same on
  every rank. The diff is therefore at the rollout's dtype: an element ships only when its bf16 bits change, and
  a step that changes nothing at bf16 ships nothing (a float32 model diffed at float32 would ship nearly every
  element at every Adam step, as an int32 position plus a float32 value: 4x a dense bf16 sync). The spec is an
  explicit override (``place=0``, ``contributes``, the gather group): a parallm parameter is not a DTensor, and
  with pipeline stages and expert ranks the contributors of one entry are not one DTensor mesh dim.
* ``delta_entry`` is the per-entry builder verl's ``hf_delta_export`` calls with the shard-local positions that
  changed since the snapshot (verl diffs bytes against its snapshot): it maps them to HF coordinates with
  :meth:`HFShard.hf_positions` and returns verl's ``(slots, dtype_str, counts, hf_idx, hf_val)``, per-slot
  pieces in slot order, int32 positions within each HF tensor. Elements a rank holds but does not contribute (a
  replica's, vocabulary padding rows) are dropped.

The gather group (verl's gather sends each entry's pieces to the group's rank 0, which must be the sender, global
rank 0) holds the ranks that contribute anything, and global rank 0: data-parallel replicas that contribute
nothing are not in it (they would send empty, padded pieces), and on them the entries carry no group (verl's
queue then skips them: it gathers nothing for ``None`` off rank 0). When rank 0 is the only contributor (or the
world is one rank) every entry carries ``None``: rank 0's pieces are already the whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl.workers.engine.spec import ShardSpec

from parallm.checkpoint.shards import hf_shard_map
from parallm.parallel.errors import exchange_rows

__all__ = ["ROLLOUT_DTYPE", "ShardExport"]

INT32_MAX = 2 ** 31 - 1
ROLLOUT_DTYPE = torch.bfloat16     # verl 0.9.1's engines' shard dtype and its checkpoint engines' rollout_dtype


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an entry of ``dtype`` is diffed and shipped at: the rollout's for floating point."""
    return ROLLOUT_DTYPE if dtype.is_floating_point else dtype


def gather_group(shards, what: str):
    """The process group of the ranks contributing any element, with global rank 0 (module docstring): ``None``
    when that is rank 0 alone; the world when it is every rank; else a new group (collective: every rank calls
    it, members or not). Non-members get ``None``."""
    if dist.get_world_size() == 1:
        return None
    rows = exchange_rows([int(any(s.contributes for s in shards))], what=what)
    members = sorted({0} | {r for r, (c,) in enumerate(rows.tolist()) if c})
    if len(members) == 1:
        return None
    if len(members) == dist.get_world_size():
        return dist.group.WORLD
    group = dist.new_group(members)
    return group if dist.get_rank() in members else None


class ShardExport:
    """The shard map of one engine's model (built on first use, collectively) and the two exports over it."""

    def __init__(self, chunks):
        self.shards = hf_shard_map(chunks, what="get_per_tensor_param_shard")
        self.by_key = {s.key: s for s in self.shards}
        self.device = next(chunks[0].parameters()).device
        self.group = gather_group(self.shards, "get_per_tensor_param_shard")
        for s in self.shards:
            for name, shape in s.slots:
                if torch.Size(shape).numel() > INT32_MAX:
                    raise NotImplementedError(f"delta export: {name} has {torch.Size(shape).numel()} elements; "
                                              "verl's delta wire addresses positions in int32")

    def shard_stream(self):
        """``(key, local flat tensor at the rollout's dtype, ShardSpec)`` per entry, in the same order on every
        rank."""
        for s in self.shards:
            t = s.tensor()
            if t is None:
                local = torch.empty(0, dtype=wire_dtype(s.dtype), device=self.device)
            else:
                if t.dtype != s.dtype:
                    raise RuntimeError(f"delta export: {s.key} is {t.dtype} here, {s.dtype} in the shard map")
                local = t.reshape(-1).to(wire_dtype(s.dtype))     # a copy when cast; else the parameter's view
            numel = sum(torch.Size(shape).numel() for _, shape in s.slots)
            yield s.key, local, ShardSpec(full_shape=(numel,), place=0, gather_group=self.group,
                                          contributes=s.contributes)

    def delta_entry(self, name, spec, place, lidx, lval):
        """verl's per-entry hook (``hf_delta_export``'s ``entry_fn``): the changed elements of this rank's shard
        ``lidx`` (flat positions) / ``lval`` as per-HF-tensor pieces."""
        s = self.by_key[name]
        k = len(s.slots)
        dtype_str = str(wire_dtype(s.dtype)).replace("torch.", "")
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
