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
4. Data parallelism: gradients are averaged over the data-parallel group (the loss is a mean over replicas;
   under context parallelism the ranks of a CP group hold the gradients of their shares of the same replica's
   tokens, so the sum runs over data x context parallelism and the scale stays 1 / dp);
   after ``forward_backward`` calls whose ``loss_fn`` returned ``(loss_sum, num_tokens)`` they are summed over
   it and divided by the calls' global token count instead (token-mean, as Megatron's
   ``calculate_per_token_loss``), which is where that objective's division happens.
   A routed expert's weight (``placement.expert`` set) already holds the gradient of every token its
   expert-parallel group routed to it; it is summed over the expert-data-parallel group (the replicas holding the
   same expert) and divided by the data-parallel size, as megatron-core's DDP does. Router and shared expert are
   dense: averaged over the whole data-parallel group. An expert that no token chose ends with a zero gradient.

Where gradients live (``param.grad`` or an fp32 ``param.main_grad``): :mod:`parallm.model.params`.

:func:`clip_grad_norm_` (after finalize_grads): the total norm of the unsharded model's gradient, each element
counted once (the placement's ``primary_slices``; the tied head copy skipped), then every gradient scaled.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..model.params import grad_of, uses_main_grad
from ..model.placement import placement_of
from ..parallel.state import _import_parallel_state, as_chunks, dims_of, kv_replica_group
from .buckets import grad_buffers_of, reduction_domains


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient tensor, created as zeros when no backward reached it."""
    g = grad_of(p)
    if g is None:
        if uses_main_grad(p):
            p.main_grad = g = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            p.grad = g = torch.zeros_like(p)
    return g


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
    """Collective over the world. See the module docstring for what it does. With gradient buckets
    (``build_optimizer(overlap_grad_reduce=True)``) it waits for the buckets already being reduced, applies the
    model-parallel corrections, reduces the remaining buckets and scales: the same operations on the same
    values (see :mod:`parallm.train.buckets` for when the bits are the same)."""
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec = chunks[0].spec
    buffers = grad_buffers_of(chunks)
    if buffers is not None:
        buffers.bind_all()
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    placed = [(p, placement_of(p)) for p in params]

    for nkv in spec.kv_head_counts:     # one KV-head count per layer shape (Gemma 4's full layers: their own)
        kv_group = kv_replica_group(nkv)
        if kv_group is None:
            continue
        grads = []
        for p, pl in placed:
            rows = pl.layout.replica_rows(layout.tp_rank, layout.tp)
            if rows is not None and getattr(pl.layout, "num_kv_heads", spec.num_kv_heads) == nkv:
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

    # the mean over replicas, or (token-mean losses) the sum over replicas divided by the global token count
    tokens = getattr(chunks[0], "pending_tokens", None)
    chunks[0].pending_tokens = None
    scale = 1.0 / layout.dp if tokens is None else 1.0 / max(tokens, 1.0)
    domains = reduction_domains(layout)
    if buffers is not None:
        buffers.launch_rest()
        buffers.wait_and_scale(scale)
        rest = [p for p, _ in placed if not buffers.manages(p)]   # domains of one rank: nothing to reduce
        if layout.dp > 1 or scale != 1.0:
            for p in rest:
                g = _grad(p)
                if scale != 1.0:
                    g.mul_(scale)
        return
    if layout.dp * layout.cp > 1:
        (dense_group, _), (expert_group, edp) = domains["dense"], domains["expert"]
        _all_reduce_coalesced([_grad(p) for p, pl in placed if pl.expert is None], dense_group, scale=scale)
        experts = [_grad(p) for p, pl in placed if pl.expert is not None]
        if edp > 1:
            _all_reduce_coalesced(experts, expert_group, scale=scale)
        else:
            for g in experts:
                g.mul_(scale)
    elif scale != 1.0:
        for p, _ in placed:
            _grad(p).mul_(scale)


def expect_microbatches(chunks, num_microbatches: int) -> None:
    """Announce that the next ``num_microbatches`` backward passes of each chunk (the pipeline engine runs one
    per microbatch per chunk; over several ``forward_backward`` calls, their total) complete this step's
    gradients, so each gradient bucket's data-parallel reduction may start as soon as the last of them has
    filled it, while the backward goes on. Call it before the step's first backward. Without gradient buckets
    (``build_optimizer(overlap_grad_reduce=True)``) it does nothing; without it nothing is reduced before
    ``finalize_grads``. More backward passes than announced is a RuntimeError in the first one too many."""
    chunks = as_chunks(chunks)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    buffers = grad_buffers_of(chunks)
    if buffers is not None:
        buffers.expect(num_microbatches)


def announce_step(chunks, num_microbatches: int) -> None:
    """What ``forward_backward`` calls before its pipeline runs: a call of ``num_microbatches`` backward passes.
    Announces them (:func:`expect_microbatches`) when the step has no announcement yet, so each bucket's
    reduction starts during this call's backward; leaves a user's announcement (the total of several calls) in
    place; after gradients accumulated without an announcement (nothing then starts before ``finalize_grads``)
    it does nothing. A call whose passes would exceed the announced count is a ValueError before it runs (the
    same on every rank: every rank ran the same calls), not a gradient accumulated into a bucket already being
    reduced. Does nothing without gradient buckets."""
    buffers = grad_buffers_of(as_chunks(chunks))
    if buffers is None:
        return
    if buffers.expected is None:
        if buffers.accumulated:
            return
        buffers.expect(num_microbatches)
    if buffers.claimed + num_microbatches > buffers.expected:
        raise ValueError(
            f"forward_backward: {num_microbatches} more backward passes than the step's announced "
            f"{buffers.expected} allow ({buffers.claimed} already run): with gradient buckets "
            "(overlap_grad_reduce=True) each call's buckets are reduced during its backward; to accumulate one "
            "step over several calls, call parallm.train.grads.expect_microbatches(chunks, total) before the "
            "first, else call finalize_grads (or zero_grad) between steps")
    buffers.claimed += num_microbatches


# -- gradient clipping ----------------------------------------------------------------------------------------
#
# The total norm is summed exactly as a per-parameter loop ``acc += vector_norm(part, p) ** p`` would sum it
# (every parameter's primary slices in chunk / parameter order, in fp32, one addition after another), so the
# result has the same bits; the per-tensor work runs in a few ``torch._foreach_*`` calls (and, on CPU, one row-wise
# norm per shape: :func:`_part_norms`) instead of a Python loop of several kernels per tensor.

class _NormPlan:
    """What the norm reads, fixed once the model is built: every parameter of the chunks in order, and per
    domain (dense, routed experts) the ``(parameter index, slices)`` that count, in parameter order; ``slices``
    None for the whole tensor, else the placement's ``primary_slices`` (possibly none). The tied head copy does
    not count."""

    def __init__(self, chunks, dims):
        self.key = (tuple(map(id, chunks)), dims.tp_rank, dims.tp)
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        self.counted: tuple[list, list] = ([], [])
        for i, p in enumerate(self.params):
            pl = placement_of(p)
            if pl.tied == "copy":
                continue
            shape = tuple(p.shape)
            slices = pl.layout.primary_slices(dims.tp_rank, dims.tp, shape)
            self.counted[pl.expert is not None].append((i, None if shape and slices == [(0, 0, shape[0])]
                                                        else slices))
        self.low_precision = any(p.dtype != torch.float32 for p in self.params)
        self.groupings: dict = {}     # _part_norms' row-norm groups, by (domain, sharded)
        self.whole = tuple([i for i, sl in c] if all(sl is None for _, sl in c) else None for c in self.counted)


def _norm_plan(chunks, dims) -> _NormPlan:
    cached = getattr(chunks[0], "_parallm_norm_plan", None)
    if cached is not None and cached.key == (tuple(map(id, chunks)), dims.tp_rank, dims.tp):
        return cached
    chunks[0]._parallm_norm_plan = plan = _NormPlan(chunks, dims)
    return plan


def _grads_of(params) -> list:
    """:func:`grad_of` of each parameter (``main_grad`` when set, else ``grad``), without a call per parameter."""
    return [g if (g := getattr(p, "main_grad", None)) is not None else p.grad for p in params]


def _norm_parts(plan: _NormPlan, grads: list, k: int) -> tuple[list[torch.Tensor], list[int]]:
    """This rank's primary gradient pieces of domain ``k`` (0 dense, 1 routed experts, which are split over the
    expert-parallel group and so combined apart) as fp32 tensors in the order the norm sums them, and the
    index of each one's parameter. Empty pieces may be among them: their norm, 0, adds nothing."""
    if plan.whole[k] is not None:     # every counted tensor whole (tp = 1, most layouts): no slicing
        owners = [i for i in plan.whole[k] if grads[i] is not None]
        parts = [grads[i] for i in owners]
    else:
        parts, owners = [], []
        for i, slices in plan.counted[k]:
            g = grads[i]
            if g is None:
                continue
            pieces = [g] if slices is None else [g.narrow(d, a, b - a) for d, a, b in slices]
            parts.extend(pieces)
            owners.extend([i] * len(pieces))
    if plan.low_precision:     # a bf16 / fp16 parameter without main_grad has a gradient of its own dtype
        parts = [part if part.dtype == torch.float32 else part.float() for part in parts]
    return parts, owners


# exponents whose pow kernel computes a vector element by element exactly as it computes a 0-dim tensor (products
# and copies; a general exponent's vectorised pow may round differently from the scalar one)
_EXACT_VECTOR_POW = (1.0, 2.0, 3.0)


# A CPU reduction over at most this many elements runs on one thread (ATen's GRAIN_SIZE), so the norm of each row
# of a stacked [k, n] tensor has the bits of the norm of that row alone, at any thread count (checked for every
# p in tests/test_clip_foreach.py). Above it a whole-tensor norm splits the work over threads and may round
# differently from a row of a stacked tensor.
_ROW_NORM_MAX_NUMEL = 32768


def _group_parts(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Which parts :func:`_part_norms` norms row by row: index tensors of the CPU parts of one shape each (non-empty,
    contiguous, at most ``_ROW_NORM_MAX_NUMEL`` elements), and the indices of the other non-empty parts."""
    groups: dict[tuple, list[int]] = {}
    rest: list[int] = []
    for j, part in enumerate(parts):
        n = part.numel()
        if n == 0:
            continue      # an empty piece: norm 0 (torch refuses the inf norm of an empty tensor)
        if part.device.type == "cpu" and n <= _ROW_NORM_MAX_NUMEL and part.is_contiguous():
            groups.setdefault(tuple(part.shape), []).append(j)
        else:
            rest.append(j)
    return [torch.tensor(idx) for idx in groups.values()], rest


def _part_norms(parts: list[torch.Tensor], norm_type: float, memo: tuple | None = None) -> torch.Tensor:
    """``torch.stack([torch.linalg.vector_norm(part, norm_type) for part in parts])`` with the same bits, in a few
    kernels. On CUDA ``torch._foreach_norm`` is one fused kernel. On CPU it is a loop of one norm per tensor, so
    there small contiguous parts of one shape (a model's many norm weights, biases, small projections) are
    stacked and normed row by row in one kernel per shape; the rest go through ``_foreach_norm``. An empty part's
    norm is 0 (for every p, inf included).

    ``memo``: ``(store, key, owners)`` when the parts are a plan's pieces of the parameters ``owners`` (their
    shapes fixed by the plan): the grouping is kept in ``store[key]`` and reused while the owners are the same and
    every part is contiguous."""
    if parts[0].device.type != "cpu" and all(p.numel() for p in parts):
        return torch.stack(torch._foreach_norm(parts, norm_type))
    grouping = None
    contiguous = all(map(torch.Tensor.is_contiguous, parts))
    if memo is not None and contiguous:
        store, key, owners = memo
        held = store.get(key)
        if held is not None and held[0] == owners:
            grouping = held[1]
    if grouping is None:
        grouping = _group_parts(parts)
        if memo is not None and contiguous:
            store[key] = (list(owners), grouping)
    return _part_norms_grouped(parts, norm_type, grouping)


def _part_norms_grouped(parts, norm_type: float, grouping) -> torch.Tensor:
    groups, rest = grouping
    norms = torch.zeros(len(parts), dtype=torch.float32, device=parts[0].device)
    for idx in groups:
        rows = torch.stack([parts[j] for j in idx.tolist()]).reshape(len(idx), -1)
        norms.index_copy_(0, idx, torch.linalg.vector_norm(rows, norm_type, dim=1))
    if rest:
        norms.index_copy_(0, torch.tensor(rest, device=norms.device),
                          torch.stack(torch._foreach_norm([parts[j] for j in rest], norm_type)))
    return norms


def _sum_of_powers(parts: list[torch.Tensor], norm_type: float, device, memo: tuple | None = None) -> torch.Tensor:
    """``sum |part|_p ** p`` (``max |part|`` for inf) as an fp32 scalar on ``device``, added in list order one
    value at a time, as ``acc += torch.linalg.vector_norm(part, p) ** p`` in a loop adds them. ``memo``: as for
    :func:`_part_norms`."""
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return _combine(_part_norms(parts, norm_type, memo), norm_type)


def _combine(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The 1-D tensor of per-part norms -> the partial: their max (inf) or the sequential sum of their p-th
    powers."""
    if norm_type == float("inf"):
        return norms.max().clamp_(min=0.0)
    return _sequential_sum(_powers(norms, norm_type))


def _powers(norms: torch.Tensor, p: float) -> torch.Tensor:
    """``norms ** p`` for a 1-D tensor, each element rounded as the 0-dim ``n ** p`` is."""
    if p in _EXACT_VECTOR_POW:
        return norms ** p
    return torch.stack(torch._foreach_pow(list(norms.unbind()), p))


def _sequential_sum(values: torch.Tensor) -> torch.Tensor:
    """``((v0 + v1) + v2) + ...`` in the dtype of the 1-D ``values``, one rounding per addition (torch's sum and
    cumsum reorder or widen the additions; numpy's ``add.accumulate`` does not). One small device-to-host copy
    for a GPU tensor."""
    import numpy as np
    host = values.detach().cpu().numpy()
    total = np.add.accumulate(host)[-1]
    return torch.tensor(total, dtype=values.dtype).to(values.device)


def _sharded_partial(parts, held, norm_type: float, device, group, memo: tuple | None = None) -> torch.Tensor:
    """The partial of ``parts`` when each rank of ``group`` holds the global gradient of its own parameters only
    (ZeRO with reduce-scattered buckets; ``held[j]``: part j is this rank's): each rank computes the norms of the
    parts it holds, one all-reduce of the vector of all parts' norms (zeros elsewhere: each entry is one rank's
    value plus zeros, exactly) gives every rank all of them, and they are combined in the same order as
    unsharded, so the bits are the same. ``memo``: ``(store, key, owners)`` of all the parts (see
    :func:`_part_norms`)."""
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    mine = [j for j, h in enumerate(held) if h]
    norms = torch.zeros(len(parts), dtype=torch.float32, device=device)
    if mine:
        if memo is not None:
            store, key, owners = memo
            memo = (store, key, [owners[j] for j in mine])
        values = _part_norms([parts[j] for j in mine], norm_type, memo)
        norms.index_copy_(0, torch.tensor(mine, device=device), values)
    dist.all_reduce(norms, group=group)
    return _combine(norms, norm_type)


def _local_norm_partials(chunks, norm_type: float, plan: _NormPlan | None = None,
                         grads: list | None = None) -> dict[str, torch.Tensor]:
    """This rank's share of the total norm, by reduction domain: ``{"model": sum |g|^p (or max |g| for inf)}``
    over the elements this rank is the one owner of (``primary_slices``; the tied head copy not at all), and
    ``"expert"`` the same over routed experts' weights. With reduce-scattered gradient buckets the share of
    every data-parallel replica is the same (:func:`_sharded_partial`).

    Keys name how the partial must be combined across ranks (:func:`_reduce_norm_partials`)."""
    dims = chunks[0].dims
    plan = plan or _norm_plan(chunks, dims)
    grads = grads if grads is not None else _grads_of(plan.params)
    device = plan.params[0].device
    buffers = grad_buffers_of(chunks)
    out = {}
    domains = reduction_domains(dims)
    for k, (key, domain) in enumerate((("model", "dense"), ("expert", "expert"))):
        parts, owners = _norm_parts(plan, grads, k)
        group, size = domains[domain]
        if buffers is not None and buffers.shard and size > 1:
            held = [buffers.holds(plan.params[i]) for i in owners]
            out[key] = _sharded_partial(parts, held, norm_type, device, group, (plan.groupings, (k, True), owners))
        else:
            out[key] = _sum_of_powers(parts, norm_type, device, (plan.groupings, (k, False), owners))
    return out


def _reduce_norm_partials(partials: dict[str, torch.Tensor], norm_type: float, dims) -> torch.Tensor:
    """Combine every rank's partials into the total norm (the same on every rank). ``"model"``: over the
    model-parallel ranks (tp, then pp); data-parallel replicas hold the same gradients after finalize_grads."""
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = partials["model"].clone()
    experts = partials["expert"].clone()
    if dims.ep > 1:   # distinct experts on each EP rank (same on expert-data-parallel replicas)
        dist.all_reduce(experts, op=op, group=dims.ep_group)
    total = torch.maximum(total, experts) if inf else total + experts
    for group, size in ((dims.tp_group, dims.tp), (dims.pp_group, dims.pp)):
        if size > 1:
            dist.all_reduce(total, op=op, group=group)
    return total if inf else total ** (1.0 / norm_type)


def clip_grad_norm_(chunks, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of the whole (unsharded) model to total norm ``max_norm``; call after finalize_grads.

    Returns the total norm before clipping (fp32 scalar, the same on every rank): the norm
    ``torch.nn.utils.clip_grad_norm_`` computes on the unsharded transformers model, where a tied weight, a
    KV head replicated over TP ranks and a TP-replicated norm weight each count once. Every gradient
    (``main_grad`` when present) is scaled in place by ``min(1, max_norm / (total + 1e-6))``, as torch does.
    ``norm_type``: any p > 0, or ``inf``. Collective over the model-parallel ranks.
    """
    chunks = as_chunks(chunks)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
    dims = dims_of(chunks)
    plan = _norm_plan(chunks, dims)
    grads = _grads_of(plan.params)
    total = _reduce_norm_partials(_local_norm_partials(chunks, norm_type, plan, grads), norm_type, dims)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    buffers = grad_buffers_of(chunks)
    if buffers is not None:   # a bucket's views scaled in one kernel
        grads = buffers.all_buffers() + [g for p, g in zip(plan.params, grads) if not buffers.manages(p)]
    grads = [g for g in grads if g is not None]
    if grads:
        torch._foreach_mul_(grads, coef)
    return total
