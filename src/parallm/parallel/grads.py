"""finalize_grads: turn every rank's local gradients into gradients of the global loss.

After :func:`parallm.forward_backward`, ``param.grad`` on each rank is the gradient of the rank's own
microbatches through its own use of the parameter. Four corrections make ``p -= lr * p.grad`` on every rank
equal to the same step on the unsharded model:

1. Replicated KV heads (``num_key_value_heads < tp``): each replica only saw its own query heads; the K/V rows of
   the fused QKV weight (and bias) are summed over the replica group.
2. Tied embeddings across pipeline stages: the embedding (first stage) and the head copy (last stage) are one
   weight used twice; their gradients are summed over Megatron's embedding group, so both copies step equally.
3. Params replicated over TP that see only part of the work on each rank are summed over the TP group: under
   sequence parallelism those fed a 1/tp slice of the tokens (``sequence_parallel = True``: norms, the value
   head), and always the per-head q/k norms of qk-norm models, which each rank applies to its own heads only
   (``parallm_tp_sum = True``).
4. Data parallelism: gradients are averaged over the data-parallel group (the loss is a mean over replicas).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..model.decoder import as_chunks
from .state import Layout, _import_parallel_state, kv_replica_group


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
    layout = Layout()
    spec = chunks[0].spec
    ps = _import_parallel_state()

    kv_group = kv_replica_group(spec.num_kv_heads)
    if kv_group is not None:
        q_rows = spec.num_heads // layout.tp * spec.head_dim
        grads = []
        for chunk in chunks:
            for layer in chunk.layers:
                qkv = layer.self_attention.linear_qkv
                grads += [_grad(p)[q_rows:] for p in (qkv.weight, qkv.bias) if p is not None]
        kv = [g.contiguous() for g in grads]
        _all_reduce_coalesced(kv, kv_group)
        for g, synced in zip(grads, kv):
            g.copy_(synced)

    # Membership from our own chunks: megatron-core's is_rank_in_embedding_group() can be stale after
    # destroy_model_parallel() + initialize_model_parallel() with another layout (it keeps the old rank list).
    tied_across = any(c.share_embeddings_and_output_weights for c in chunks) and layout.pp > 1
    shared = [c.shared_embedding_or_output_weight() for c in chunks if c.pre_process or c.post_process]
    if tied_across and shared:
        _all_reduce_coalesced([_grad(p) for p in shared], ps.get_embedding_group())

    if layout.tp > 1:
        sp = [_grad(p) for c in chunks for p in c.parameters()
              if getattr(p, "sequence_parallel", False) or getattr(p, "parallm_tp_sum", False)]
        _all_reduce_coalesced(sp, layout.tp_group)

    if layout.dp > 1:
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        _all_reduce_coalesced([_grad(p) for p in params], layout.dp_group, scale=1.0 / layout.dp)
