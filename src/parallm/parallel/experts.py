"""Token dispatch for expert parallelism, on torch.distributed's all-to-all and all-gather (no CUDA streams, CPU and
GPU alike).

The experts of a MoE layer are split over the ``ep`` ranks of an expert-parallel group: rank r holds experts
``[r * E / ep, (r + 1) * E / ep)``. :func:`dispatch` sends each routed slot (token, choice), sorted by expert, to
the rank holding the chosen expert and regroups what arrives by local expert; :func:`combine` is its inverse.
Both are differentiable (the backward of an all-to-all is the all-to-all with the splits swapped).

Under tensor parallelism the experts are TP-split too (expert TP = TP): every TP rank computes its shard of every
local expert, on the same rows. Passing ``tp_group`` to :func:`dispatch` makes it Megatron's dispatch: each TP rank
sends only *its share* of the tokens over the expert-parallel group (no TP rank sends what another sends), then
the TP ranks all-gather what they received, so each holds the rows of all of them; :func:`combine` reduce-scatters
the experts' TP partial sums back (each TP rank gets the complete outputs of its own rows) before the all-to-all
back. Uneven row counts travel through these equal-size collectives padded to the largest. Helpers for the
caller's side: :func:`share_of` / :func:`gather_shares` (a TP replica's rows split into shares and back).

Host synchronisation: split sizes vary from call to call (dropless routing), so the ranks first exchange the
per-expert counts (an all-to-all of ``E`` integers over the expert-parallel group, an all-gather of the received
counts over TP), and :func:`dispatch` reads every size it needs in one device-to-host copy: one wait per MoE layer
on a GPU. Nothing else reads device values on the host, in the forward or the backward.

Determinism: rows move only by permutations (gathers whose index has no repeats) and by concatenation; sums are
collectives or reductions, never index_add / scatter-add (whose colliding atomic adds on CUDA vary in order).

Collective over the expert-parallel group (and the TP group with ``tp_group``): every member runs the same MoE
layers in the same order (they do: they are data-parallel replicas of the same pipeline stage running the same
schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_gather_single, reduce_scatter_single


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split as ``in_splits`` go to the group's ranks; ``out_splits`` rows arrive from each."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` with uneven splits (python lists, as gloo and NCCL take them)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _all_gather_rows(x, group, size):
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x, group, size):
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's ``[m, ...]`` rows, concatenated in rank order. Backward: the sum over ranks of the
    gradient, each rank keeping its own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _all_gather_rows(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group, ctx.size), None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: the sum over ranks of ``[size * m, ...]``, each rank keeping its own ``m`` rows. Backward: an
    all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _reduce_scatter_rows(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.group, ctx.size), None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def _unpad(x: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """Rows ``[q * width, q * width + sizes[q])`` of each block q, concatenated."""
    return torch.cat([x.narrow(0, q * width, n) for q, n in enumerate(sizes)])


def _repad(x: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """Inverse of :func:`_unpad`: block q's ``sizes[q]`` rows, then zero rows up to ``width``."""
    return torch.cat([_pad_rows(part, width) for part in x.split(sizes)])


# -- a TP replica's rows as shares, and back ------------------------------------------------------------------

def share_sizes(rows: int, tp: int) -> list[int]:
    """Rows of each TP rank's share of ``rows`` replicated rows: contiguous, the first ``rows % tp`` one longer."""
    per, extra = divmod(rows, tp)
    return [per + (q < extra) for q in range(tp)]


class _ShareOf(torch.autograd.Function):
    """Forward: this TP rank's share of a TP replica (a view). Backward: the shares' gradients gathered, so every
    rank gets the gradient of the whole replica (each share's gradient is complete on its own rank)."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.group = sizes, group
        return x.narrow(0, sum(sizes[:rank]), sizes[rank])

    @staticmethod
    def backward(ctx, grad):
        width, size = max(ctx.sizes), len(ctx.sizes)
        full = _all_gather_rows(_pad_rows(grad, width), ctx.group, size)
        return _unpad(full, ctx.sizes, width), None, None, None


class _GatherShares(torch.autograd.Function):
    """Inverse of :class:`_ShareOf`: forward gathers every rank's share into the whole replica; backward keeps this
    rank's share of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank = sizes, rank
        width = max(sizes)
        return _unpad(_all_gather_rows(_pad_rows(x, width), group, len(sizes)), sizes, width)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(0, sum(ctx.sizes[:ctx.rank]), ctx.sizes[ctx.rank]), None, None, None


def share_of(x: torch.Tensor, *, rank: int, size: int, group) -> torch.Tensor:
    """TP rank ``rank``'s share (:func:`share_sizes`) of the rows of ``x``, a TP replica; see :class:`_ShareOf`."""
    return _ShareOf.apply(x, share_sizes(x.shape[0], size), rank, group)


def gather_shares(x: torch.Tensor, *, rows: int, rank: int, size: int, group) -> torch.Tensor:
    """Every TP rank's share (of ``rows`` rows in all) into the whole replica; see :class:`_GatherShares`."""
    return _GatherShares.apply(x, share_sizes(rows, size), rank, group)


# -- slots, counts ---------------------------------------------------------------------------------------------

@dataclass
class Slots:
    """The ``n * k`` routed slots of ``n`` tokens (slot ``t * k + j``: token t's choice j), sorted by expert:
    ``order`` (stable, so token-major within an expert), ``unsort`` its inverse, ``token[s]`` the token of sorted
    slot s."""
    order: torch.Tensor
    unsort: torch.Tensor
    token: torch.Tensor
    k: int


def sort_slots(choices: torch.Tensor) -> tuple[Slots, torch.Tensor]:
    """``(Slots, experts of the sorted slots)`` for the ``[n, k]`` expert choices."""
    flat = choices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    k = choices.shape[1]
    slots = Slots(order, inverse_permutation(order), torch.div(order, k, rounding_mode="floor"), k)
    return slots, flat.index_select(0, order)


class _RepeatRows(torch.autograd.Function):
    """Forward: the token row of every sorted slot (each token k times). Backward: the slot gradients back in
    token-major order (a permutation) and summed over the k choices (a reduction): no accumulating scatter,
    deterministic on every device."""

    @staticmethod
    def forward(ctx, x, slots):
        ctx.slots = slots
        return x.index_select(0, slots.token)

    @staticmethod
    def backward(ctx, grad):
        slots = ctx.slots
        grad = grad.index_select(0, slots.unsort)
        return grad.view(-1, slots.k, *grad.shape[1:]).sum(dim=1), None


def slots_of(x: torch.Tensor, slots: Slots) -> torch.Tensor:
    """The routed slots of the tokens ``x`` ``[n, H]`` in sorted order; see :class:`_RepeatRows`."""
    return _RepeatRows.apply(x, slots)


class _WeightedSum(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * rows[slot (t, j)]`` for ``rows`` in sorted-slot order: the slots gathered
    back token-major (a permutation) and reduced by a batched matrix product. Backward: the gradient of each
    sorted slot is its token's gradient (a gather) times its weight, in place; the weights' gradient a batched
    product with the gathered rows kept from the forward. No accumulating scatter; one ``[n * k, H]`` buffer
    each way."""

    @staticmethod
    def forward(ctx, rows, weights, slots):
        n, k = weights.shape
        picked = rows.index_select(0, slots.unsort).view(n, k, rows.shape[-1])
        ctx.save_for_backward(picked, weights)
        ctx.slots = slots
        return torch.bmm(weights.unsqueeze(1), picked).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        picked, weights = ctx.saved_tensors
        slots = ctx.slots
        grad = grad.contiguous()
        grad_weights = torch.bmm(picked, grad.unsqueeze(2)).squeeze(2)
        grad_rows = grad.index_select(0, slots.token)
        grad_rows.mul_(weights.reshape(-1).index_select(0, slots.order).unsqueeze(1))
        return grad_rows, grad_weights, None


def weighted_sum(rows: torch.Tensor, weights: torch.Tensor, slots: Slots) -> torch.Tensor:
    """Each token's expert outputs (``rows``, sorted-slot order) weighted by ``weights`` ``[n, k]`` (same dtype)
    and summed over its k choices: ``[n, H]``. See :class:`_WeightedSum`."""
    return _WeightedSum.apply(rows, weights, slots)


class _Permute(torch.autograd.Function):
    """Forward: ``x[index]`` for a permutation ``index`` of the rows. Backward: ``grad[inverse]``, a gather as
    well (autograd's backward of a gather zero-fills and index-adds)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in the order of the permutation ``index`` (``inverse``: its inverse); see :class:`_Permute`."""
    return _Permute.apply(x, index, inverse)


def expert_counts(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert from the slots' experts in sorted order, on the device (no host sync: ``bincount`` on
    CUDA reads its input's maximum on the host)."""
    edges = torch.arange(num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, edges).diff()


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


# -- dispatch / combine ----------------------------------------------------------------------------------------

@dataclass
class Dispatch:
    """What :func:`combine` needs to send expert outputs back where their tokens came from.

    ``local_counts``: rows per local expert, in local-expert order, of the tensor :func:`dispatch` returned (on the
    host), ``local_counts_device`` the same on the device. ``send_splits`` / ``recv_splits``: the expert-parallel
    all-to-all's; ``tp_sizes``: rows each TP rank received from it (``tp_group`` given); ``regroup``: the
    permutation from arrival order to local-expert order and its inverse (None: already in that order)."""
    local_counts: list[int]
    local_counts_device: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    tp_sizes: list[int] | None
    regroup: tuple[torch.Tensor, torch.Tensor] | None
    ep_group: object
    tp_group: object


def _regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``counts[s, e]`` rows (``total`` in all) arrive from source s for local expert e, ordered by (s, e); the
    index that reorders them by (e, s) (each local expert's rows contiguous)."""
    flat = counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(counts)             # where segment (s, e) begins, (s, e) order
    seg_start, seg_len = starts.t().reshape(-1), counts.t().reshape(-1)   # segments in (e, s) order
    new_start = seg_len.cumsum(0) - seg_len
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(seg_start - new_start, seg_len,
                                                                               output_size=total)


def dispatch(rows: torch.Tensor, expert_counts: torch.Tensor, *, ep: int, group, tp: int = 1,
             tp_group=None) -> tuple[torch.Tensor, Dispatch]:
    """Send ``rows`` (one per routed slot, sorted by global expert; ``expert_counts[e]`` of them for expert e, on
    the device) to the ranks holding their experts. Returns the rows this rank's experts must process, grouped
    by local expert, and the :class:`Dispatch` that :func:`combine` reverses. With ``tp_group`` (``tp`` > 1) the
    rows are this TP rank's share: what the TP ranks received is all-gathered over TP (see the module doc).
    Reads the sizes on the host once."""
    num_experts = expert_counts.numel()
    local = num_experts // ep
    per_rank = expert_counts.view(ep, local)
    if ep > 1:
        received = torch.empty_like(expert_counts)
        dist.all_to_all_single(received, expert_counts.contiguous(), group=group)   # equal splits: E / ep each
        received = received.view(ep, local)                                       # [source rank, local expert]
    else:
        received = per_rank
    sharing = tp_group is not None and tp > 1
    counts = received
    if sharing:
        counts = received.new_empty((tp * ep, local))             # [(tp rank, source), expert]
        all_gather_single(counts, received.contiguous(), group=tp_group)
    counts = counts.reshape(-1, local)                                            # [(tp rank, source), expert]
    # every size the host needs, in one device-to-host copy (one wait per MoE layer on a GPU)
    host = torch.cat([per_rank.sum(1), counts.reshape(-1)]).tolist()
    send_splits, table = host[:ep], host[ep:]
    sources = len(table) // local
    by_source = [sum(table[s * local:(s + 1) * local]) for s in range(sources)]
    local_counts = [sum(table[s * local + x] for s in range(sources)) for x in range(local)]
    me = dist.get_rank(tp_group) if sharing else 0
    recv_splits = by_source[me * ep:(me + 1) * ep] if ep > 1 else []
    arrived = all_to_all(rows, recv_splits, send_splits, group) if ep > 1 else rows
    tp_sizes = None
    if sharing:
        tp_sizes = [sum(by_source[q * ep:(q + 1) * ep]) for q in range(tp)]
        width = max(tp_sizes)
        arrived = _unpad(_GatherRows.apply(_pad_rows(arrived, width), tp_group, tp), tp_sizes, width)
    regroup = None
    if sources > 1:
        index = _regroup_index(counts, sum(by_source))
        regroup = (index, inverse_permutation(index))
        arrived = permute_rows(arrived, *regroup)
    return arrived, Dispatch(local_counts, counts.sum(0), send_splits, recv_splits, tp_sizes, regroup, group,
                             tp_group if sharing else None)


def combine(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Inverse of :func:`dispatch`: expert outputs (grouped by local expert) back to the ranks and slot order
    their tokens came from; with ``tp_group`` the TP ranks' partial sums are added up on the way (each TP rank
    receives the complete outputs of the rows it sent)."""
    if plan.regroup is not None:
        index, inverse = plan.regroup
        rows = permute_rows(rows, inverse, index)
    if plan.tp_group is not None:
        width, tp = max(plan.tp_sizes), len(plan.tp_sizes)
        mine = plan.tp_sizes[dist.get_rank(plan.tp_group)]
        rows = _ReduceScatterRows.apply(_repad(rows, plan.tp_sizes, width), plan.tp_group, tp).narrow(0, 0, mine)
    if not plan.recv_splits:
        return rows
    return all_to_all(rows, plan.send_splits, plan.recv_splits, plan.ep_group)
