"""finalize_grads: turn every rank's local gradients into gradients of the global loss.

After :func:`parallm.forward_backward`, ``param.grad`` on each rank is the gradient of the rank's own
microbatches through its own use of the parameter. Four corrections, each read from the parameter's
:class:`parallm.model.placement.Placement`, make ``p -= lr * p.grad`` on every rank equal to the same step on
the unsharded model:

1. Replicated KV heads (``num_key_value_heads < tp``): each replica only saw its own query heads; the rows the
   layout reports as ``replica_rows`` (K/V rows of the fused QKV weight and bias) are summed over the group of
   TP ranks holding the same KV head.
2. Tied embeddings across pipeline stages (``tied`` "embedding" / "copy"): one weight used twice; the two
   copies' gradients are summed over Megatron's embedding group, so both copies step equally.
3. ``tp_sum`` params (TP-replicated but fed part of the work on each rank: norms, row-parallel biases and the
   value head under sequence parallelism; per-head q/k norms always) are summed over the TP group.
4. Data parallelism: gradients are averaged over the data-parallel group (the loss is a mean over replicas).
   A routed expert's weight (``placement.expert`` set) already holds the gradient of every token its
   expert-parallel group routed to it; it is summed over the expert-data-parallel group (the replicas holding the
   same expert) and divided by the data-parallel size, as megatron-core's DDP does. Router and shared expert are
   dense: averaged over the whole data-parallel group. An expert that no token chose ends with a zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..model.decoder import as_chunks
from ..model.placement import placement_of
from .state import _import_parallel_state, dims_of, kv_replica_group


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group, scale: float | None = None) -> None:
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if scale is not None:
        flat.mul_(scale)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_grads(chunks) -> None:
    """Collective over the world. See the module docstring for what it does."""
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec = chunks[0].spec
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    placed = [(p, placement_of(p)) for p in params]

    kv_group = kv_replica_group(spec.num_kv_heads)
    if kv_group is not None:
        grads = []
        for p, pl in placed:
            rows = pl.layout.replica_rows(layout.tp_rank, layout.tp)
            if rows is not None:
                grads.append(_grad(p)[rows[0]:rows[1]])
        kv = [g.contiguous() for g in grads]
        _all_reduce_coalesced(kv, kv_group)
        for g, synced in zip(grads, kv):
            g.copy_(synced)

    # Membership from our own chunks: megatron-core's is_rank_in_embedding_group() can be stale after
    # destroy_model_parallel() + initialize_model_parallel() with another layout (it keeps the old rank list).
    tied = [_grad(p) for p, pl in placed if pl.tied is not None]
    if tied:
        _all_reduce_coalesced(tied, _import_parallel_state().get_embedding_group())

    if layout.tp > 1:
        _all_reduce_coalesced([_grad(p) for p, pl in placed if pl.tp_sum], layout.tp_group)

    if layout.dp > 1:
        _all_reduce_coalesced([_grad(p) for p, pl in placed if pl.expert is None], layout.dp_group,
                              scale=1.0 / layout.dp)
        experts = [_grad(p) for p, pl in placed if pl.expert is not None]
        if layout.edp > 1:
            _all_reduce_coalesced(experts, layout.edp_group, scale=1.0 / layout.dp)
        else:
            for g in experts:
                g.mul_(1.0 / layout.dp)
