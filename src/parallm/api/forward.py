"""``forward``: the whole batch's output on every rank, through the pipeline when ``pp > 1``."""

from __future__ import annotations

import torch

from ..model.decoder import DecoderChunk
from ..model.loaded import require_loaded
from ..model.logprobs import TokenStats, check_output
from ..parallel.comm import gather_last_dim
from ..parallel.pipeline import broadcast_from_last_stage, run_pipeline
from ..parallel.state import as_chunks, dims_of, require_initialized
from ..train.batching import fewest_bins
from .batch import (caller_order, default_forward_microbatches, microbatches, real_lengths, token_budget_bins,
                    unpack_batch)
from .checks import call_fingerprint, check_batch, checked_call
from .replay import check_replay, routed_of_call, start_replay


def gather_output(chunk: DecoderChunk, out, temperature: float = 1.0, request=None):
    """Last-stage output -> ``[B, S, V]`` fp32 logits (TP-gathered, vocab padding removed, divided by
    ``temperature``) or ``[B, S]`` values. With a log-prob ``request`` the chunk already returned ``[B, S]``
    log-probs (or :class:`TokenStats`), which pass through. Differentiable."""
    if request is not None:
        return out
    out = out.transpose(0, 1)  # [B, S, ...]; contiguous for padded logits and packed outputs
    if chunk.task in ("value", "hidden"):
        return out.float()
    logits = gather_last_dim(out, chunk.dims.tp_group)
    logits = logits[..., :chunk.spec.vocab_size].float()
    return logits / temperature if temperature != 1.0 else logits


def _output_shape(chunk, b, s, request):
    if request is not None:
        return (2, b, s) if request.entropy else (b, s)
    spec = chunk.spec
    return {"causal_lm": (b, s, spec.vocab_size), "hidden": (b, s, spec.hidden_size)}.get(chunk.task, (b, s))


def stackable(out):
    return torch.stack(tuple(out)) if isinstance(out, TokenStats) else out


def forward(chunks, input_ids, attention_mask=None, position_ids=None, *, output=None, temperature=1.0,
            token_chunk=None, num_microbatches=None, max_tokens_per_microbatch=None, routed_experts=None,
            return_routed_experts=False):
    """Whole-batch output on every rank.

    ``output=None``: fp32 logits ``[B, S, V]`` (causal_lm; divided by ``temperature``) or values ``[B, S]``
    (value). ``output="logprobs"``: fp32 ``[B, S]``, ``log_softmax(logits[b, t] / temperature)[input_ids[b,
    t+1]]`` (0 at ``t = S-1`` and at padded positions). ``output="logprobs+entropy"``: a :class:`TokenStats` of
    two such tensors. At ``pp > 1`` the batch runs through the pipeline as ``num_microbatches`` microbatches
    along dim 0, their sizes differing by at most one (default :func:`default_forward_microbatches`: ``pp``, up
    to ``4 pp`` for batches with enough tokens, at most one per sequence), so the stages overlap instead of
    waiting for each other; results are the same for any count (at ``pp == 1`` it is ignored).
    ``max_tokens_per_microbatch``: microbatches by a token budget instead, at any pp (as in
    :func:`forward_backward`); outputs come back in the caller's order. ``input_ids`` may be a batch mapping
    (:func:`forward_backward`; its other entries are ignored, except ``routed_experts``).
    Log-probs are computed vocab-parallel in chunks of ``token_chunk`` tokens (default: about
    32 MiB of fp32 logits per chunk on CPU, 2 GiB on GPU: ``model.logprobs.DEFAULT_CHUNK_BYTES``), never
    gathering ``[..., V]``.

    Router replay (mixture-of-experts models, docs/moe.md): ``routed_experts`` (or a batch mapping's
    ``"routed_experts"`` entry, not both), ``[B, S, num_moe_layers, top_k]`` integers, or ``[T, num_moe_layers,
    top_k]`` for the batch's ``T`` real tokens in row order: every MoE layer routes each real token to those
    experts instead of its router's top-k (MoE layers numbered in model order from 0; values at padding
    positions are ignored), the combine weights being the router's probabilities of those experts.
    ``return_routed_experts=True``: returns ``(output, routed)``, ``routed`` int64 ``[B, S, num_moe_layers,
    top_k]`` the experts every MoE layer routed each token with (the replayed ones when given), -1 at padding
    positions, the same on every rank.
    """
    require_initialized("forward")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)

    def check():
        request = check_output(output, temperature, task=chunks[0].task, token_chunk=token_chunk)
        ids, mask, pos, extras = unpack_batch(input_ids, attention_mask, position_ids)
        batch = check_batch(chunks, ids, mask, pos)
        given = check_replay(chunks, routed_experts, extras, batch[1], record=return_routed_experts)
        b = batch[0].shape[0]
        if max_tokens_per_microbatch is not None:
            bins = fewest_bins(real_lengths(batch[1]), max_tokens_per_microbatch)
            m = num_microbatches or 1
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        else:
            bins = None
            m = num_microbatches if num_microbatches is not None else default_forward_microbatches(
                b, layout.pp, batch[0].numel(), batch[0].device)
            if isinstance(m, bool) or not isinstance(m, int) or m < 1 or (b and m > b):
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number from 1 to the "
                                 f"batch size {b}")
        require_loaded(chunks, "forward")
        return (batch, request, bins, given), call_fingerprint(
            layout, batch, m, request, given, temperature=temperature, token_chunk=token_chunk,
            budget=max_tokens_per_microbatch), m
    budget = max_tokens_per_microbatch
    ((input_ids, attention_mask, position_ids), request, bins, given), m = checked_call(
        layout, check, what="forward",
        count_moe=budget is None and layout.pp > 1 and layout.ep > 1 and chunks[0].spec.moe is not None,
        default=num_microbatches is None)
    order = sizes = None
    if budget is not None:     # bins of at most `budget` real tokens, as many on every replica
        order, sizes = token_budget_bins(layout, attention_mask, max(bins, m, layout.pp))
        input_ids, attention_mask, position_ids = (t[order] for t in (input_ids, attention_mask, position_ids))
        if given is not None:
            given = given[order]
        m = len(sizes)
    replaying = given is not None or return_routed_experts
    if replaying:
        start_replay(chunks, given, m if layout.pp > 1 or order is not None else 1, sizes,
                      record=return_routed_experts)
    try:
        out = _forward_run(chunks, layout, input_ids, position_ids, attention_mask, m, sizes, order, request,
                           temperature)
    finally:
        recorded = [c.router_replay.stop() for c in chunks] if replaying else None
    if not return_routed_experts:
        return out
    return out, routed_of_call(chunks, layout, recorded, input_ids.shape, order)


def _forward_run(chunks, layout, input_ids, position_ids, attention_mask, m, sizes, order, request, temperature):
    """:func:`forward` once the batch is checked (and in bin order under a token budget)."""
    if layout.pp == 1 and order is None:
        return gather_output(chunks[0], chunks[0].compute(input_ids, position_ids, attention_mask, stats=request),
                             temperature, request)
    b, s = input_ids.shape
    mbs = microbatches(chunks, input_ids, position_ids, attention_mask, m, sizes=sizes)
    if layout.pp == 1:      # a token budget at pp = 1: the microbatches one after another
        length = chunks[0].rope_length(position_ids, attention_mask)
        outs = []
        for i, mb in enumerate(mbs):
            chunks[0].router_replay.microbatch = i
            outs.append(stackable(gather_output(chunks[0], chunks[0].compute(
                *mb[:3], stats=request, rope_length=length, **({"cp": mb[3]} if len(mb) > 3 else {})),
                temperature, request)))
        return caller_order(outs, order, request)
    with torch.no_grad():
        outs = run_pipeline(chunks, mbs, last_stage_fn=lambda chunk, out, i: stackable(
                                gather_output(chunk, out, temperature, request)),
                            backward=False, compute_kwargs={"stats": request,
                                                            "rope_length": chunks[0].rope_length(position_ids,
                                                                                                 attention_mask)},
                            on_step=lambda kind, i, v: setattr(chunks[v].router_replay, "microbatch", i))
    joined = torch.cat(outs, dim=1 if request is not None and request.entropy else 0) if outs else None
    out = broadcast_from_last_stage(layout, joined, _output_shape(chunks[0], b, s, request), torch.float32,
                                    input_ids.device)
    if order is not None:
        return caller_order([out], order, request)
    return TokenStats(out[0], out[1]) if request is not None and request.entropy else out
