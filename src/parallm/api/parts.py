"""``forward_backward_parts``: several ``forward_backward`` calls' microbatches in one pipeline schedule.

Each part is what one call would be (a batch mapping, its microbatch count, its ``loss_fn``); the schedule runs
the parts' microbatches one part after another, every microbatch exactly as its own call would run it (the same
rows, the same shapes: a part's microbatches are formed from its batch alone), each back-propagating its value
divided by its own part's microbatch count. So every gradient accumulates the same terms in the same order as the
calls one after another, bit for bit, while the model runs one schedule: one set of checks agreed over the
ranks, one pipeline fill and drain (at ``pp > 1`` the parts' microbatches overlap in the pipeline instead of each
call paying its own bubble), one objective exchange.

``before_step(part)`` runs before each microbatch's forward and backward step (the backward too: under
activation recomputation the backward re-runs the forward): the caller switches per-part state there. The Tinker
server (:mod:`parallm.integrations.tinker`) co-batches its LoRA clients' ``forward_backward`` requests this way,
each part's microbatches running with that client's adapters (:class:`parallm.model.layers.lora.LoraState`'s
bank).

Refused (ValueError, every rank): a mixture-of-experts model with a load-balancing loss (each microbatch's
weight depends on the call's microbatch count), parts whose dynamic-NTK RoPE lengths differ (the rotation depends
on the whole call's length), token budgets and router replay (not offered here).
"""

from __future__ import annotations

from ..parallel.state import as_chunks, dims_of, require_initialized
from .objective import last_stage_stats, objective_of
from .step import Call, LastStage, _prepare, _run

__all__ = ["forward_backward_parts"]


def forward_backward_parts(chunks, parts, *, before_step=None, output=None):
    """Forward and backward of every part ``(batch, num_microbatches, loss_fn)`` (``batch`` a mapping as
    :func:`parallm.forward_backward`'s batch form) in one schedule; see the module docstring. Returns the mean
    over all microbatches of ``loss_fn(mb) / (the part's count)``-weighted values, as ``forward_backward`` would
    for one call (callers that need per-part values capture them in their ``loss_fn``). Collective over the
    world; a ``loss_fn`` that raises on any rank raises on every rank after the schedule, as in
    ``forward_backward`` (the gradients then hold partial sums)."""
    require_initialized("forward_backward_parts")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    if not parts:
        raise ValueError("forward_backward_parts: no parts")
    moe = chunks[0].spec.moe
    if moe is not None and moe.aux_loss_coef:
        raise ValueError("forward_backward_parts: a load-balancing loss (router_aux_loss_coef "
                         f"{moe.aux_loss_coef}) weighs each microbatch by its call's count: run the calls one by one")
    calls = [_prepare(chunks, layout, batch, None, None, loss_fn=fn, num_microbatches=m, output=output,
                      temperature=1.0, token_chunk=None, metric_reduce=None, budget=None, routed_experts=None)
             for batch, m, fn in parts]
    lengths = {chunks[0].rope_length(c.positions, c.mask) for c in calls}
    if len(lengths) > 1:
        raise ValueError(f"forward_backward_parts: the parts' dynamic RoPE lengths differ ({sorted(lengths)}): "
                         "run the calls one by one")
    owner = [i for i, c in enumerate(calls) for _ in range(c.m)]
    merged = Call(mbs=[mb for c in calls for mb in c.mbs],
                  extra_mbs=[e for c in calls for e in (c.extra_mbs or [{}] * c.m)],
                  request=calls[0].request, reductions=calls[0].reductions, m=len(owner), sizes=None, given=None,
                  positions=calls[0].positions, mask=calls[0].mask, device=calls[0].device)
    stage = LastStage(merged, None, 1.0, None, parts=[(parts[i][2], calls[i].m) for i in owner])
    step = None if before_step is None else (lambda m: before_step(owner[m]))
    aux_values = _run(chunks, layout, merged, stage, None, before_step=step)
    stats, metric_sums, metric_max = last_stage_stats(layout, stage, merged.m, merged.device)
    return objective_of(chunks, layout, stage, stats, metric_sums, metric_max, aux_values, 0.0, merged.m,
                        merged.device)
