"""Token dispatch for expert parallelism, on torch.distributed's all-to-all (no CUDA streams, CPU and GPU alike).

The experts of a MoE layer are split over the ``ep`` ranks of an expert-parallel group: rank r holds experts
``[r * E / ep, (r + 1) * E / ep)``. Every rank routes its own tokens; :func:`dispatch` sends each (token, choice)
slot to the rank holding the chosen expert and regroups what arrives by local expert, :func:`combine` is its
inverse. Both are differentiable (the backward of an all-to-all is the all-to-all with the splits swapped). Split
sizes vary from call to call (dropless routing), so every call first exchanges the per-expert counts (one small
all-to-all of ``E`` integers per rank).

Collective over the expert-parallel group: every member must run the same MoE layers in the same order (they
do: they are data-parallel replicas of the same pipeline stage running the same schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


@dataclass
class Dispatch:
    """What :func:`combine` needs to send expert outputs back where their tokens came from.

    ``local_counts``: rows per local expert, in local-expert order, of the tensor :func:`dispatch` returned.
    """
    local_counts: list[int]
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor | None      # (source rank, expert) order -> (expert, source rank) order
    group: object


def _regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``counts[s, e]`` rows (``total`` in all) arrive from source s for local expert e, ordered by (s, e); the
    index that reorders them by (e, s) (each local expert's rows contiguous)."""
    flat = counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(counts)             # where segment (s, e) begins, (s, e) order
    seg_start, seg_len = starts.t().reshape(-1), counts.t().reshape(-1)   # segments in (e, s) order
    new_start = seg_len.cumsum(0) - seg_len
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(seg_start - new_start, seg_len,
                                                                               output_size=total)


def dispatch(rows: torch.Tensor, expert_counts: torch.Tensor, *, ep: int, group) -> tuple[torch.Tensor, Dispatch]:
    """Send ``rows`` (one per routed slot, sorted by global expert; ``expert_counts[e]`` of them for expert e) to
    the ranks holding their experts. Returns the rows this rank's experts must process, grouped by local expert,
    and the :class:`Dispatch` that :func:`combine` reverses."""
    num_experts = expert_counts.numel()
    local = num_experts // ep
    if ep == 1:
        return rows, Dispatch(expert_counts.tolist(), [], [], None, group)
    per_rank = expert_counts.view(ep, local)
    received = torch.empty_like(expert_counts)
    dist.all_to_all_single(received, expert_counts.contiguous(), group=group)   # equal splits: E / ep each
    received = received.view(ep, local)                                       # [source rank, local expert]
    # every count the host needs, in one device-to-host copy (one wait per MoE layer on a GPU, not four)
    sizes = torch.cat([per_rank.sum(1), received.sum(1), received.sum(0)]).tolist()
    send_splits, recv_splits, local_counts = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    arrived = all_to_all(rows, recv_splits, send_splits, group)
    regroup = _regroup_index(received, sum(recv_splits))
    return arrived.index_select(0, regroup), Dispatch(local_counts, send_splits, recv_splits, regroup, group)


def combine(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Inverse of :func:`dispatch`: expert outputs (grouped by local expert) back to the ranks and slot order
    their tokens came from."""
    if plan.regroup is None:
        return rows
    inverse = torch.empty_like(plan.regroup)
    inverse[plan.regroup] = torch.arange(plan.regroup.numel(), device=plan.regroup.device)
    back = rows.index_select(0, inverse)
    return all_to_all(back, plan.send_splits, plan.recv_splits, plan.group)
