"""Small differentiable collectives that megatron-core offers only with CUDA allocations."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's tensor along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _GatherLastDim.apply(x, group)


def all_gather_single(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``inp`` concatenated along dim 0 into ``output`` (rank order of ``group``): torch's
    ``all_gather_single`` where it exists (torch >= 2.13, which deprecates ``all_gather_into_tensor`` with a
    FutureWarning on every call), else ``all_gather_into_tensor``. parallm's own all-gathers go through here
    (``tests/test_call_collectives.py`` checks the package for direct calls of the deprecated names)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, inp, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``inp`` summed over ``group`` and scattered along dim 0 (this rank's block into ``output``): torch's
    ``reduce_scatter_single`` where it exists (torch >= 2.13 deprecates ``reduce_scatter_tensor``), else
    ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, inp, group=group, async_op=async_op)


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0, in the rank order of ``group``."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x, group=group)
    return out


class _GatherRowsKeepOwn(torch.autograd.Function):
    """Forward: every rank's tensor stacked along dim 0 (rank order of ``group``). Backward: this rank's slice of
    the gradient. For outputs that every rank of the group then uses identically (the same loss on the same
    gathered tensor): each rank's gradient of its own rows is already the whole gradient of those rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=0)[rank].contiguous(), None


def gather_rows_keep_own(x: torch.Tensor, group) -> torch.Tensor:
    """:class:`_GatherRowsKeepOwn` (the identity for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherRowsKeepOwn.apply(x, group)


class _GatherRowsSumBack(torch.autograd.Function):
    """Forward: every rank's tensor stacked along dim 0 (rank order of ``group``). Backward: the gradients every
    rank computed for the gathered rows, summed onto the rows' owner (a reduce-scatter): for tensors each rank
    uses differently (context parallelism's keys and values, which every rank's queries attend to)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        reduce_scatter_single(out, grad, group=ctx.group)
        return out, None


def gather_rows_sum_back(x: torch.Tensor, group) -> torch.Tensor:
    """:class:`_GatherRowsSumBack` (the identity for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherRowsSumBack.apply(x, group)


class RingExchange:
    """Point-to-point around the ring of ``group`` (rank i sends to i + 1, receives from i - 1, peers asked of the
    group): :meth:`start` posts one send and one receive together (``batch_isend_irecv``: NCCL pairs them without
    buffering), :meth:`wait` returns the received tensor. Used by context parallelism's ring attention, whose
    compute overlaps the transfer."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        self.works, self.received = [], None

    def start(self, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        self.received = torch.empty_like(tensor)
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, group=self.group),
                                             dist.P2POp(dist.irecv, self.received, self.prev, group=self.group)])
        self._sent = tensor          # kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self._sent = [], None
        out, self.received = self.received, None
        return out
