"""Router replay through ``forward`` / ``forward_backward`` (docs/moe.md): the given experts checked and split
with the microbatches, and the recorded ones joined into one ``[B, S, L, k]`` tensor."""

from __future__ import annotations

import torch

from ..train.batching import inverse


REPLAY_KEY = "routed_experts"    # the batch mapping's entry for router replay


def check_replay(chunks, routed_experts, extras, attention_mask, *, record: bool = False):
    """Router replay's input, checked (:func:`parallm.model.layers.routing.check_routed_experts`): the keyword or the
    batch mapping's ``"routed_experts"`` entry (taken out of ``extras``), as ``[B, S, L, k]`` int64, or None."""
    if not isinstance(record, bool):
        raise ValueError(f"return_routed_experts must be True or False, got {record!r}")
    if extras is not None and REPLAY_KEY in extras:
        if routed_experts is not None:
            raise ValueError("routed_experts given twice: as a keyword and in the batch mapping; pass one")
        routed_experts = extras.pop(REPLAY_KEY)
    moe = chunks[0].spec.moe
    if (routed_experts is not None or record) and moe is None:
        raise ValueError(f"{'routed_experts' if routed_experts is not None else 'return_routed_experts'}: "
                         f"{chunks[0].spec.architecture} has no mixture-of-experts layers")
    if routed_experts is None:
        return None
    from ..model.layers.routing import check_routed_experts, moe_layer_indices
    spec = chunks[0].spec
    return check_routed_experts(routed_experts, attention_mask, moe_layers=moe_layer_indices(spec),
                                num_layers=spec.num_layers, top_k=moe.top_k, num_experts=moe.num_experts)


def start_replay(chunks, given, m: int, sizes=None, *, record: bool) -> None:
    """Every chunk's router replay on for one call: ``given`` ``[B, S, L, k]`` (or None) split as the ``m``
    microbatches are (:func:`microbatches`)."""
    parts = None
    if given is not None:
        parts = list(given.split(sizes)) if sizes is not None else list(given.tensor_split(m))
    for chunk in chunks:
        chunk.router_replay.start(parts, record=record)


def routed_of_call(chunks, layout, recorded, shape, order) -> torch.Tensor:
    """``forward(return_routed_experts=True)``'s second result: the chunks' recorded microbatches joined into
    ``[B, S, L, k]`` int64 (-1 at padding), the MoE layers of every pipeline stage (a MAX all-reduce over the
    pipeline group: each stage fills its own layers' columns, -1 elsewhere), in the caller's order."""
    from ..model.layers.routing import moe_layer_indices
    spec = chunks[0].spec
    device = next(chunks[0].parameters()).device
    b, s = shape
    full = torch.full((b, s, len(moe_layer_indices(spec)), spec.moe.top_k), -1, dtype=torch.long, device=device)
    start = 0
    for m in sorted({m for rec in recorded for m in rec}):
        part = torch.stack([rec[m] for rec in recorded if m in rec]).amax(0)
        full[start:start + part.shape[0]] = part
        start += part.shape[0]
    if layout.pp > 1:
        torch.distributed.all_reduce(full, op=torch.distributed.ReduceOp.MAX, group=layout.pp_group)
    if order is not None:
        full = full.index_select(0, torch.tensor(inverse(order), dtype=torch.long, device=device))
    return full
