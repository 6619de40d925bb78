"""The verl engine's weights for the rollout: verl's ``get_per_tensor_param`` (full HF tensors, any checkpoint
engine) and the ``delta_sharded`` sparse sync's ``get_per_tensor_param_shard`` / ``get_per_tensor_param_delta_shard``
(:mod:`.delta`). A mixin of :class:`parallm.integrations.verl.engine.ParallmEngine` (reads its ``chunks``,
``optimizer``, ``_shards`` and ``_resident``).

Every export is a generator that, while it runs, holds the parameters on the device (brought back if they were
offloaded) and, when it ends or is closed, leaves them offloaded again if they were: verl offloads again after its
naive (in-process) sync only, so the other checkpoint engines (nccl, delta_sharded, kimi, ...) would otherwise
leave the actor's parameters on the device through the rollout.
"""

from __future__ import annotations

import parallm

__all__ = ["RolloutWeights"]


class RolloutWeights:
    """verl's weight-export methods of the engine (see the module docstring)."""

    # verl's delta snapshots live in host memory; pinning them (verl's default) competes with every other pinned
    # pool (parallm.offload's included), as verl's Megatron engine says of its own
    delta_pin_snapshots = False

    def _with_params(self, open_stream):
        """``open_stream()``'s items, with the parameters resident while it runs (module docstring)."""
        with self._resident(kinds=("params",)):
            yield from open_stream()

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """HF-named full tensors (``parallm.export_hf_tensors``), on every rank; collective: every rank must
        iterate the generator to its end (verl's weight senders do). Each yielded tensor is the consumer's own
        (``copy=True``): verl's ``delta_sharded`` seed and its ``kimi`` engine keep the tensors of many buckets
        before they copy them, which the export stream's reused buffers would overwrite."""
        return self._with_params(lambda: parallm.export_hf_tensors(self.chunks, copy=True)), None

    def _shard_export(self):
        """The shard map (:class:`.delta.ShardExport`), built on first use, collectively, from resident
        parameters (its slices are cut from them): call it inside :meth:`_with_params`."""
        if self._shards is None:
            from .delta import ShardExport
            self._shards = ShardExport(self.chunks)
        return self._shards

    def get_per_tensor_param_shard(self, **kwargs):
        """Each rank's local shard of every exported tensor group at the rollout's dtype, ``(name, local_flat,
        ShardSpec)``, the same sequence on every rank (:mod:`.delta`); what verl's ``prime_delta_snapshots``
        snapshots."""
        return self._with_params(lambda: self._shard_export().shard_stream()), None

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's sparse sync payload: per tensor group, the elements changed (at the rollout's dtype) since the
        snapshot, in the HF tensors' coordinates ``(slots, dtype_str, counts, hf_idx, hf_val, gather_group)``
        (verl's ``hf_delta_export`` over :meth:`get_per_tensor_param_shard` with parallm's entry builder). Needs
        ``prime_delta_snapshots`` first. verl's diff refreshes each entry's snapshot as it yields the entry, so a
        sync that stops part-way (an exception, ``close()``) would leave snapshots ahead of the rollout and a later
        sync would never ship those changes: the snapshots are then dropped, and the next delta sync fails at
        once (verl's "no seed snapshot" assertion) until ``prime_delta_snapshots`` runs after a full sync."""
        from verl.workers.engine.utils import hf_delta_export
        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})

        def stream():
            export = self._shard_export()
            complete = False
            try:
                yield from hf_delta_export(export.shard_stream(), self._delta_shard_snap, export.delta_entry)
                complete = True
            finally:
                if not complete:       # snapshots refreshed for entries the rollout may never have received
                    self._delta_shard_snap.clear()

        return self._with_params(stream), None
