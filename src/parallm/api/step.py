"""``forward_backward``: one call's microbatches through the schedule, forward and backward, with the caller's
loss on the last stage (:class:`LastStage`), then the objective and metrics over the replicas
(:mod:`parallm.api.objective`)."""

from __future__ import annotations

import dataclasses

import torch

from ..model.layers.moe import AuxScales
from ..model.loaded import require_loaded
from ..model.logprobs import check_output
from ..parallel.pipeline import run_pipeline
from ..parallel.state import as_chunks, dims_of, require_initialized
from ..train.batching import fewest_bins
from ..train.grads import announce_step
from ..train.metrics import MetricAccumulator, check_reductions
from .batch import check_extras, microbatches, real_lengths, split_extras, token_budget_bins, unpack_batch
from .checks import call_fingerprint, check_batch, checked_call
from .forward import gather_output
from .objective import last_stage_stats, loss_parts, objective_of, zero_loss
from .replay import check_replay, start_replay


def forward_backward(chunks, input_ids, attention_mask=None, *, loss_fn, num_microbatches: int = 1,
                     position_ids=None, output=None, temperature=1.0, token_chunk=None, metric_reduce=None,
                     max_tokens_per_microbatch=None, routed_experts=None):
    """Forward and backward of ``loss_fn`` over ``num_microbatches`` microbatches (split along dim 0).

    Two forms. Positional: ``forward_backward(chunks, input_ids, attention_mask, ...)`` calls
    ``loss_fn(out, input_ids_mb, attention_mask_mb)``. Batch: ``forward_backward(chunks, batch, ...)`` with a
    mapping (a dict of tensors, or a ``tensordict.TensorDict``) holding ``input_ids``, optional
    ``attention_mask`` and ``position_ids``, and any other tensors whose first dimension is the batch (per
    sample ``[B, ...]`` or per token ``[B, S, ...]``: advantages, old / reference log-probs, loss masks); every
    entry is split with the microbatches and ``loss_fn(out, mb)`` gets the microbatch's dict (``position_ids``
    defaulted). Under context parallelism ``out`` is the whole microbatch's output on every rank of the CP group,
    so per-token entries are not split over CP. Packed ``cu_seqlens``-style batches are refused (pass padded
    ``[B, S]`` tensors; ``build_model(packed=True)`` removes the padding inside).
    ``out`` is what :func:`forward` returns for that microbatch with the same ``output`` / ``temperature``
    (differentiable). Gradients accumulate as the gradient
    of ``mean_m loss_fn(mb_m)``: in ``param.grad`` for fp32 parameters, in fp32 ``param.main_grad`` for
    bf16 / fp16 ones (:func:`parallm.model.params.grad_of`); call :func:`parallm.finalize_grads` before
    stepping. Schedules: one microbatch's forward then its backward at ``pp == 1``; 1F1B (interleaved with
    virtual stages) at ``pp > 1`` (docs/pipeline.md). Each data-parallel replica passes its own batch. Returns
    that mean, averaged over data-parallel replicas (the global loss), on every rank.

    An empty local batch (0 rows; ``num_microbatches`` then need not divide anything) runs ``num_microbatches``
    empty microbatches, the schedule of its peers (the same messages, all-to-alls and gradient-bucket
    collectives): ``loss_fn`` is not called on them and they back-propagate zero. With a token-mean ``loss_fn``
    they add nothing (the step equals the one without that replica's data); with a scalar one, whose mean an
    empty microbatch does not have, any empty microbatch is a ValueError on every rank after the backward.

    With gradient buckets (``build_optimizer(overlap_grad_reduce=True)``) the call announces its microbatches
    (:func:`parallm.train.grads.announce_step`), so each bucket's reduction starts during the backward once its
    last gradient is in; to accumulate one step over several calls, announce their total first with
    :func:`parallm.train.grads.expect_microbatches`.

    Mixture-of-experts models whose config sets ``output_router_logits=True``: write ``aux_m`` for microbatch
    m's load-balancing loss on m's real tokens: by default (``build_model(aux_loss="per_layer")``) the sum over
    MoE layers of each layer's loss (transformers' ``load_balancing_loss_func`` for that layer alone; layers
    summed as Megatron does), with ``aux_loss="pooled"`` transformers' function over all layers at once
    (docs/moe.md). With a scalar ``loss_fn`` the objective is ``mean_m [loss_fn(mb_m) + router_aux_loss_coef *
    aux_m]``, averaged over replicas; the returned loss includes it.

    Token-mean losses: ``loss_fn`` may return ``(loss_sum, num_tokens)`` (a scalar tensor and a count: a number or
    a tensor) for every microbatch instead. The objective is then ``sum(loss_sum) / sum(num_tokens)`` over all
    microbatches and all data-parallel replicas (verl's ``loss_agg_mode="token-mean"``), not a mean of
    per-microbatch means, and that is what is returned. Each ``loss_sum`` is back-propagated unscaled and
    :func:`parallm.finalize_grads` divides the gradients by the global token count (summed over every such call
    since the last finalize, so gradient accumulation over several calls is token-mean over all of them; a count
    of 0 divides by 1). With a load-balancing loss the objective is
    ``sum(loss_sum) / N + coef * sum(num_tokens_m * aux_m) / N`` over all microbatches m of all replicas,
    ``N = sum(num_tokens)``: the token-mean loss plus ``coef`` times the token-weighted mean of the microbatches'
    load-balancing losses. For one microbatch on one replica, with ``build_model(aux_loss="pooled")``, that is
    exactly transformers' ``loss + router_aux_loss_coef * aux_loss`` with a token-mean ``loss`` (with the default
    ``"per_layer"``, Megatron's sum over layers, about L times larger); a microbatch with no tokens adds nothing. (The
    backward weights ``aux_m`` by ``coef * num_tokens_m``, known once ``loss_fn`` has run on the last stage and
    sent to the others with m's gradient, and ``finalize_grads`` divides by ``N`` as it does the rest.) Mixing
    the two kinds within a call, or within one step before ``finalize_grads``, is a ValueError.

    Token budget: ``max_tokens_per_microbatch=n`` forms the microbatches from the real tokens
    (``attention_mask``) instead of equal row counts: the sequences are spread, longest first onto the least
    loaded, over the fewest bins of at most ``n`` tokens (:mod:`parallm.train.batching`; verl's dynamic batch
    size), the count agreed over the data-parallel replicas (the largest; at least ``num_microbatches`` and at
    least ``pp``, so that the pipeline stages overlap), so
    every replica runs the same schedule (a replica with fewer sequences than bins runs empty microbatches).
    Batch entries travel with their rows. A sequence longer than ``n`` is a ValueError. Use a token-mean
    ``loss_fn``: the objective is then the same whatever the bins (a scalar loss's mean over microbatches
    depends on them). Every rank passes the same ``n``.

    Metrics: ``loss_fn`` may return ``(loss, metrics)`` or ``((loss_sum, num_tokens), metrics)``, ``metrics`` a
    dict of scalar tensors (or numbers) with the same names for every microbatch; ``forward_backward`` then
    returns ``(objective, metrics)``, the metrics reduced over the microbatches and data-parallel replicas as
    ``metric_reduce`` (``{name: "mean" | "sum" | "max" | "min"}``) says, fp32 scalars, the same on every rank
    at every pipeline stage. ``"mean"`` (the default) weights each microbatch by its ``num_tokens`` for a
    token-mean loss (a per-microbatch token mean becomes the global token mean), by 1 for a scalar loss
    (:mod:`parallm.train.metrics`). Every replica with data must return the same names (else ValueError
    everywhere).

    Router replay (mixture-of-experts models): ``routed_experts`` (or the batch mapping's ``"routed_experts"``
    entry; either form of :func:`forward`'s) makes every MoE layer route each real token to the given experts,
    the combine weights being the router's probabilities of those experts, so the router is trained on the
    routing the rollout engine used (docs/moe.md). It is split with the microbatches (and the context-parallel
    split) and is not handed to ``loss_fn``. A load-balancing loss counts the replayed experts.

    A ``loss_fn`` that raises on some ranks: those ranks finish the schedule back-propagating zero for that
    microbatch and the later ones (their peers get every message and collective they wait for), then every rank
    raises at the end of the call (the raising rank its own exception, the others the same type naming it). The
    process groups stay usable; the gradients hold the failed call's partial sums: zero them before going on.
    """
    require_initialized("forward_backward")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    call = _prepare(chunks, layout, input_ids, attention_mask, position_ids, loss_fn=loss_fn,
                    num_microbatches=num_microbatches, output=output, temperature=temperature,
                    token_chunk=token_chunk, metric_reduce=metric_reduce, budget=max_tokens_per_microbatch,
                    routed_experts=routed_experts)
    moe = chunks[0].spec.moe
    coef = moe.aux_loss_coef if moe is not None else 0.0
    scales = AuxScales(coef, call.m) if coef else None
    stage = LastStage(call, loss_fn, temperature, scales)
    aux_values = _run(chunks, layout, call, stage, scales)
    stats, metric_sums, metric_max = last_stage_stats(layout, stage, call.m, call.device)
    return objective_of(chunks, layout, stage, stats, metric_sums, metric_max, aux_values, coef, call.m,
                        call.device)


@dataclasses.dataclass
class Call:
    """One ``forward_backward`` call once checked and agreed: its microbatches (in bin order under a token
    budget), their batch-mapping entries (None: the positional form), the log-prob request, the metrics'
    reductions, the microbatch count and sizes, router replay's experts, the whole batch's positions and mask
    (for the RoPE length), the device."""
    mbs: list
    extra_mbs: list | None
    request: object
    reductions: dict
    m: int
    sizes: list | None
    given: torch.Tensor | None
    positions: torch.Tensor
    mask: torch.Tensor
    device: torch.device


def _prepare(chunks, layout, input_ids, attention_mask, position_ids, *, loss_fn, num_microbatches, output,
             temperature, token_chunk, metric_reduce, budget, routed_experts) -> Call:
    """The call's checks (local, then agreed over the world: :func:`parallm.api.checks.checked_call`), the token
    budget's bins, the microbatches."""
    def check():
        request = check_output(output, temperature, task=chunks[0].task, token_chunk=token_chunk)
        ids, mask, pos, extras = unpack_batch(input_ids, attention_mask, position_ids)
        batch = check_batch(chunks, ids, mask, pos)
        b = batch[0].shape[0]
        bins = None
        if budget is not None:
            bins = fewest_bins(real_lengths(batch[1]), budget)
            if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        elif not isinstance(num_microbatches, int) or num_microbatches < 1 or b % num_microbatches:
            raise ValueError(f"batch size {b} does not split into num_microbatches={num_microbatches}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(output, batch) -> loss (or loss_fn(output, "
                            "input_ids, attention_mask) with the positional form)")
        if chunks[0].config.params_dtype == torch.float16:
            raise ValueError("forward_backward: float16 parameters need loss scaling, which parallm does not do "
                             "(small fp16 gradients underflow to zero); train in bfloat16 (same memory, fp32 "
                             "main_grad) or float32. float16 models can still run forward")
        reductions = check_reductions(metric_reduce)
        given = check_replay(chunks, routed_experts, extras, batch[1])
        extras = check_extras(extras, batch[0])
        require_loaded(chunks, "forward_backward")
        return (batch, request, extras, reductions, bins, given), call_fingerprint(
            layout, batch, num_microbatches, request, given, extras=extras, temperature=temperature,
            token_chunk=token_chunk, budget=budget), num_microbatches
    ((ids, mask, pos), request, extras, reductions, bins, given), _ = checked_call(
        layout, check, what="forward_backward", count_moe=layout.ep > 1 and chunks[0].spec.moe is not None)
    if request is not None:   # the head's weight gradient goes straight into its existing gradient buffer
        request = dataclasses.replace(request, accumulate=True)
    m, sizes = num_microbatches, None
    if budget is not None:    # bins of at most the budget's real tokens, as many per replica
        order, sizes = token_budget_bins(layout, mask, max(bins, num_microbatches, layout.pp))
        index = torch.tensor(order, dtype=torch.long, device=ids.device)
        ids, mask, pos = (t.index_select(0, index) for t in (ids, mask, pos))
        if extras:
            extras = {k: v.index_select(0, index.to(v.device)) for k, v in extras.items()}
        if given is not None:
            given = given.index_select(0, index.to(given.device))
        m = len(sizes)
    return Call(mbs=microbatches(chunks, ids, pos, mask, m, sizes=sizes), extra_mbs=split_extras(extras, m, sizes),
                request=request, reductions=reductions, m=m, sizes=sizes, given=given, positions=pos, mask=mask,
                device=ids.device)


class LastStage:
    """The last pipeline stage's work per microbatch: the output gathered, ``loss_fn`` called on it, what is
    back-propagated returned. Keeps per microbatch ``records[m] = (value, kind, num_tokens)`` (kind "pair",
    "scalar" or "empty"), the metrics, and ``loss_fn``'s first exception on this rank (``failure``: the rank then
    back-propagates zero for the rest of the call, its peers' messages and collectives unchanged, and every rank
    raises once the schedule is over)."""

    def __init__(self, call: Call, loss_fn, temperature, scales, *, parts=None):
        self.call, self.loss_fn, self.temperature, self.scales = call, loss_fn, temperature, scales
        self.parts = parts          # forward_backward_parts: per microbatch (loss_fn, divisor); None: the call's
        self.records: dict = {}
        self.failure: list = []
        self.metrics = MetricAccumulator(call.reductions)

    def __call__(self, chunk, out, m):
        call = self.call
        ids, pos, mask = call.mbs[m][:3]
        loss_fn, divisor = (self.loss_fn, call.m) if self.parts is None else self.parts[m]
        result = gather_output(chunk, out, self.temperature, call.request)
        kind, tokens = "empty", 0.0
        if not self.failure and ids.shape[0]:
            try:
                if call.extra_mbs is None:
                    returned = loss_fn(result, ids, mask)
                else:
                    returned = loss_fn(result, {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                                **call.extra_mbs[m]})
                value, tokens, values = loss_parts(returned)
                kind = "scalar" if tokens is None else "pair"
                self.metrics.add(values, 1.0 if tokens is None else tokens)
            except Exception as e:  # noqa: BLE001 - agreed on by every rank after the schedule
                self.failure.append(e)
        if self.failure or kind == "empty":   # the same messages and collectives as the peers, zero gradients
            value, kind, tokens = zero_loss(result), "empty" if not self.failure else "scalar", 0.0
        self.records[m] = (value.detach().float(), kind, 0.0 if tokens is None else tokens)
        if self.scales is not None:      # the weight of m's load-balancing loss in the backward (AuxScales)
            self.scales.tokens[m] = -1.0 if kind == "scalar" else tokens
        return value / divisor if kind == "scalar" else value    # what is back-propagated


def _run(chunks, layout, call: Call, stage: LastStage, scales, before_step=None) -> list:
    """The schedule (1F1B, interleaved with virtual stages) over the call's microbatches, the load-balancing
    weights and router replay on around it; returns the chunks' load-balancing values. ``before_step(m)``: called
    before each forward and backward step of microbatch ``m``."""
    if scales is not None:
        for chunk in chunks:
            chunk.moe_aux.start(scales)
    if call.given is not None:    # router replay: each microbatch's experts, set per step below
        start_replay(chunks, call.given, call.m, call.sizes, record=False)

    def on_step(kind, m, v):
        if before_step is not None:
            before_step(m)
        if scales is not None:
            chunks[v].moe_aux.microbatch = m
        chunks[v].router_replay.microbatch = m
    announce_step(chunks, len(call.mbs))
    try:
        run_pipeline(chunks, call.mbs, last_stage_fn=stage, backward=True, compute_kwargs={
            "stats": call.request, "rope_length": chunks[0].rope_length(call.positions, call.mask)},
            on_step=on_step, side=scales.tokens if scales is not None and layout.pp > 1 else None)
    finally:
        aux_values = [v for chunk in chunks for v in chunk.moe_aux.stop()]
        for chunk in chunks:
            chunk.router_replay.stop()
    return aux_values
