"""After ``forward_backward``'s schedule: the last stage's statistics (each microbatch's loss kind, value and token
count, failures, the metrics) sent to every stage, reduced over the data-parallel replicas, and turned into the
objective (a mean over microbatches, or a token mean) and the reduced metrics; errors raised on every rank."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..model.logprobs import TokenStats
from ..parallel.errors import spread_failure
from ..parallel.pipeline import broadcast_from_last_stage
from ..train.metrics import as_vector, finish, local_vector, spec_hash

_FIXED = 14    # forward_backward's fixed statistics (see last_stage_stats), before the per-microbatch counts


def last_stage_stats(layout, stage, num_microbatches: int, device):
    """``(stats, metric_sums, metric_max)``, the same on every rank of the replica: the last stage's statistics
    (layout: :data:`_FIXED` fixed numbers, then each microbatch's token count, -1 for a scalar loss), the TP / CP
    ranks of the last stage agreeing by a MAX (a ``loss_fn`` may have raised on some of them only), broadcast from
    the last stage; then the metrics' sums, maxima and spec. The microbatches' values, token counts and metrics
    stayed on the device during the schedule (no host sync per microbatch or metric): they are read here, once
    per call, with the statistics."""
    records, failure, metrics = stage.records, stage.failure, stage.metrics
    # [microbatches returning a pair, returning a scalar, empty, sum of the values, sum of the token counts, ranks
    # whose loss_fn raised, replicas with data, with metrics, the metric spec's hash and its square, the lengths
    # of the metric sums / maxima / spec, microbatches with num_tokens < 0; each microbatch's count (-1: a scalar
    # loss)]
    mine, metric_sums, metric_max = None, [], []
    if records:
        kinds = [records[m][1] for m in range(num_microbatches)]
        counts = as_vector([-1.0 if records[m][1] == "scalar" else records[m][2] for m in range(num_microbatches)],
                           device)
        metric_sums, metric_max = local_vector(metrics) if not failure else ([], [])
        h = spec_hash(metrics.spec()) if not failure else 0
        pair = torch.tensor([k == "pair" for k in kinds], device=device)
        head = as_vector([kinds.count("pair"), kinds.count("scalar"), kinds.count("empty"),
                          torch.stack([v for v, _, _ in records.values()]).double().sum(),
                          counts.clamp(min=0.0).sum(), float(bool(failure)),
                          float(kinds.count("empty") < num_microbatches), float(h > 0), h, h * h,
                          len(metric_sums) - len(metrics.spec()), len(metric_max), len(metrics.spec()),
                          ((counts < 0) & pair).sum()], device)
        mine = torch.cat([head, counts])
        if layout.tp * layout.cp > 1:
            torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX,
                                         group=layout.tp_cp_group if layout.cp > 1 else layout.tp_group)
    stats = broadcast_from_last_stage(layout, mine, (_FIXED + num_microbatches,), torch.float64, device).cpu()
    n_sums, n_max, n_spec = (int(x) for x in stats[10:13])
    if n_sums + n_max + n_spec:    # the metrics' sums, maxima and spec bytes, to every stage (zeros on failure)
        width = n_sums + n_spec + n_max
        flat = metric_sums + metric_max
        local = as_vector(flat if len(flat) == width else [0.0] * width, device) if records else None
        flat = broadcast_from_last_stage(layout, local, (width,), torch.float64, device).cpu()
        metric_sums, metric_max = flat[:n_sums + n_spec].tolist(), flat[n_sums + n_spec:].tolist()
    return stats, metric_sums, metric_max


def objective_of(chunks, layout, stage, stats, metric_sums, metric_max, aux_values, coef: float,
                 num_microbatches: int, device):
    """The call's result from the replica's statistics: the load-balancing loss added as the backward weighted
    it, one all-reduce over the data-parallel replicas, then (the same numbers on every rank: tp x cp x pp x dp
    is the world, so what is raised here is raised everywhere) a ``loss_fn`` failure spread, the kinds checked,
    and the objective (with the metrics when ``loss_fn`` returned any)."""
    if coef:    # what the backward weighted each microbatch's load-balancing loss with (AuxScales)
        per = _load_balancing_per_microbatch(chunks, aux_values, layout, device, num_microbatches)
        stats[3] += coef * (per.sum() if stats[1] else (per * stats[_FIXED:].clamp(min=0.0)).sum())
    total = stats[:_FIXED]
    if layout.dp > 1:      # one all-reduce: the kinds' counts, the values, the tokens, failures of every replica
        total = total.to(device)
        torch.distributed.all_reduce(total, group=layout.dp_group)
        total = total.cpu()
    if total[5]:        # a loss_fn raised somewhere: its message to every rank, then raised everywhere
        spread_failure(stage.failure[0] if stage.failure else None, what="forward_backward")
    if total[13]:       # read with the statistics, not per microbatch
        raise ValueError(f"forward_backward: loss_fn returned a negative num_tokens for {int(total[13])} "
                         "microbatch(es) (all data-parallel replicas); counts must be >= 0")
    pairs, scalars, empty = (int(x) for x in total[:3])
    reported = _reduce_metrics(layout, total, metric_sums, metric_max, device)
    if pairs and scalars:
        raise ValueError(f"forward_backward: loss_fn returned (loss_sum, num_tokens) for {pairs} and a scalar for "
                         f"{scalars} of the {pairs + scalars + empty} microbatches (all data-parallel replicas); "
                         "return one kind")
    if scalars and empty:
        raise ValueError(f"forward_backward: {empty} of the {layout.dp} x {num_microbatches} microbatches "
                         "(data-parallel replicas x microbatches) hold no rows, and loss_fn returns a scalar, a "
                         "mean per microbatch, which an empty one does not have; return (loss_sum, num_tokens) "
                         "(a token mean, to which empty microbatches add nothing)")
    if not pairs:        # the mean over microbatches (and over data-parallel replicas)
        if pending_tokens(chunks) is not None:
            raise ValueError("forward_backward: a scalar loss_fn after a (loss_sum, num_tokens) one before "
                             "finalize_grads; the gradients of one step come from one kind")
        objective = (total[3] / (num_microbatches * layout.dp)).float().to(device)
    else:     # token-mean: sum(loss_sum) / sum(num_tokens) over microbatches and data-parallel replicas
        add_pending_tokens(chunks, float(total[4]))
        objective = (total[3] / max(float(total[4]), 1.0)).float().to(device)
    return objective if reported is None else (objective, reported)


def _reduce_metrics(layout, total, sums: list[float], maxima: list[float], device):
    """The metrics over every replica (:mod:`parallm.train.metrics`), or None when no loss_fn returned any.
    ``total``: forward_backward's statistics summed over the replicas; ``sums`` / ``maxima``: this replica's.
    Every replica with data must return metrics of the same names and reductions (checked exactly from the
    spec hashes' sum and sum of squares), else a ValueError on every rank."""
    with_data, with_metrics, h, h2 = (float(x) for x in total[6:10])
    if not with_metrics:
        return None
    if with_metrics != with_data or h * h != with_metrics * h2:
        raise ValueError("forward_backward: loss_fn returned metrics on some data-parallel replicas and not on "
                         "others, or metrics of other names or reductions; return the same metrics everywhere")
    n_sums, n_max, n_spec = (int(round(float(x) / with_metrics)) for x in total[10:13])
    if not sums:           # a replica with no data (empty microbatches): zeros, which add nothing
        sums, maxima = [0.0] * (n_sums + n_spec), [-math.inf] * n_max
    sums_t = torch.tensor(sums, dtype=torch.float64, device=device)
    max_t = torch.tensor(maxima, dtype=torch.float64, device=device)
    if layout.dp > 1:
        torch.distributed.all_reduce(sums_t, group=layout.dp_group)
        if n_max:
            torch.distributed.all_reduce(max_t, op=torch.distributed.ReduceOp.MAX, group=layout.dp_group)
    return finish(sums_t.cpu(), max_t.cpu(), int(with_metrics), n_spec, device)


def _load_balancing_per_microbatch(chunks, values, layout, device, num_microbatches: int) -> torch.Tensor:
    """``[num_microbatches]`` fp64: each microbatch's sum over every MoE layer of its load-balancing loss, the same
    on every rank of the replica: summed over the pipeline stages (each holds its layers' values) and, under
    sequence / context parallelism, over TP / CP (each rank holds its tokens' share). ``values``: the chunks'
    ``(microbatch, value)`` records."""
    per = torch.zeros(num_microbatches, dtype=torch.float32, device=device)
    for m, v in values:
        per[m] += v.float().to(device)
    if chunks[0].sequence_parallel:
        torch.distributed.all_reduce(per, group=layout.tp_group)
    if layout.cp > 1:
        torch.distributed.all_reduce(per, group=layout.cp_group)
    if layout.pp > 1:
        torch.distributed.all_reduce(per, group=layout.pp_group)
    return per.double().cpu()


def zero_loss(result) -> torch.Tensor:
    """A loss whose gradient is zero, through the same graph as ``result`` (a tensor or a TokenStats): what a
    rank whose ``loss_fn`` raised back-propagates, so that its backward makes the same collectives and sends as
    its peers'."""
    tensors = list(result) if isinstance(result, TokenStats) else [result]
    return sum((t * 0).sum() for t in tensors)


def loss_parts(result):
    """``loss_fn``'s return -> ``(value, num_tokens or None, metrics or None)``: a scalar tensor, or a pair
    ``(loss_sum, num_tokens)`` whose count is a number or a one-element tensor; either of them may come as
    ``(it, metrics)``, ``metrics`` a dict of scalars."""
    metrics = None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], Mapping):
        result, metrics = result
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise ValueError(f"loss_fn must return a scalar tensor or (loss_sum, num_tokens); got a sequence of "
                             f"{len(result)}")
        value, tokens = result
        if torch.is_tensor(tokens):     # stays on the device (checked >= 0 with the call's statistics)
            tokens = tokens.detach().double().sum()
        else:
            tokens = float(tokens)
            if not tokens >= 0:
                raise ValueError(f"loss_fn's num_tokens must be >= 0, got {tokens}")
    else:
        value, tokens = result, None
    if not (torch.is_tensor(value) and value.dim() == 0):
        got = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (or (loss_sum, num_tokens) with a scalar loss_sum), "
                         f"got {'a loss_sum of ' if tokens is not None else ''}{got}")
    return value, tokens, metrics


def pending_tokens(chunks):
    """The token count of the (loss_sum, num_tokens) calls since the last finalize_grads, or None."""
    return getattr(chunks[0], "pending_tokens", None)


def add_pending_tokens(chunks, count: float) -> None:
    chunks[0].pending_tokens = (pending_tokens(chunks) or 0.0) + count
