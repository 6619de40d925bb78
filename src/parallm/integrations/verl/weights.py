"""The verl engine's weights for the rollout: verl's ``get_per_tensor_param`` (full HF tensors, any checkpoint
engine) and the ``delta_sharded`` sparse sync's ``get_per_tensor_param_shard`` / ``get_per_tensor_param_delta_shard``
(:mod:`.delta`). A mixin of :class:`parallm.integrations.verl.engine.ParallmEngine` (reads its ``chunks``,
``optimizer``, ``device_type``, ``_shards``)."""

from __future__ import annotations

import parallm

__all__ = ["RolloutWeights"]


class RolloutWeights:
    """verl's weight-export methods of the engine (see the module docstring)."""

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """HF-named full tensors (``parallm.export_hf_tensors``), on every rank; collective: every rank must
        iterate the generator to its end (verl's weight senders do). Offloaded parameters are brought back
        first (verl's worker offloads them again after the sync, as for its FSDP engine)."""
        self._onload_params()
        return parallm.export_hf_tensors(self.chunks), None

    def _onload_params(self) -> None:
        """Offloaded parameters back on the device for an export (verl's worker offloads them again after)."""
        if self.chunks is not None and self.device_type != "cpu":
            parallm.onload(self.chunks, self.optimizer, params=True, grads=False, optimizer_state=False)

    # verl's delta snapshots live in host memory; pinning them (verl's default) competes with every other pinned
    # pool (parallm.offload's included), as verl's Megatron engine says of its own
    delta_pin_snapshots = False

    def _shard_export(self):
        self._onload_params()
        if self._shards is None:
            from .delta import ShardExport
            self._shards = ShardExport(self.chunks)
        return self._shards

    def get_per_tensor_param_shard(self, **kwargs):
        """Each rank's local shard of every exported tensor group, ``(name, local_flat, ShardSpec)``, the same
        sequence on every rank (:mod:`.delta`); what verl's ``prime_delta_snapshots`` snapshots."""
        return self._shard_export().shard_stream(), None

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's sparse sync payload: per tensor group, the elements changed since the snapshot in the HF tensors'
        coordinates ``(slots, dtype_str, counts, hf_idx, hf_val, gather_group)`` (verl's ``hf_delta_export`` over
        :meth:`get_per_tensor_param_shard` with parallm's entry builder). Needs ``prime_delta_snapshots`` first."""
        from verl.workers.engine.utils import hf_delta_export
        export = self._shard_export()
        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})
        return hf_delta_export(export.shard_stream(), self._delta_shard_snap, export.delta_entry), None
