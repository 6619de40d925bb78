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
