"""RMSNorms over the whole query / key projection (MiniMax-M2's ``q_norm`` / ``k_norm``): one RMS over all heads of
a token at once, ``q_norm.weight [num_heads * head_dim]`` and ``k_norm.weight [num_kv_heads * head_dim]``, as
transformers' ``MiniMaxM2Attention`` normalises ``q_proj(x)`` / ``k_proj(x)`` before splitting them into heads.

Under tensor parallelism each rank holds only its heads (and the weights' slices for them), so the mean of
squares spans ranks: every rank takes the mean over its own heads, and one all-reduce over the TP group (q and k
together: ``[S, B, 2]``) averages them. Every rank holds as many channels as every other, so the average of the
ranks' means is the mean over the whole projection; with fewer KV heads than ranks each KV head sits on
``tp / nkv`` ranks, and the average still counts each head once (every head ``tp / nkv`` times, divided by
``tp``). The all-reduce's backward is an all-reduce of the gradient: every rank's output depends on every rank's
sum of squares. Computed in fp32, the weight times the normed input cast back (transformers' ``MiniMaxM2RMSNorm``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _TPSum(torch.autograd.Function):
    """Sum over ``group`` whose gradient is the sum of the ranks' gradients (each rank uses the whole sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_mean(x: torch.Tensor, group) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``group`` (differentiable); ``x`` itself when ``group`` is None."""
    if group is None:
        return x
    return _TPSum.apply(x, group) / dist.get_world_size(group)


class WholeProjectionNorm(nn.Module):
    """One TP rank's share of a projection-wide RMSNorm: ``weight [heads * head_dim]``, this rank's heads' channels
    of the HF weight (query heads split as the query rows; KV heads as the fused QKV's k rows, replicated with
    them). Applied by :func:`whole_projection_qk_norm`, which shares one all-reduce between q and k."""

    def __init__(self, heads: int, head_dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim, dtype=dtype, device=device))

    def scale(self, normed: torch.Tensor) -> torch.Tensor:
        """``weight * normed`` for ``normed [..., heads, head_dim]``."""
        return self.weight.view(self.heads, self.head_dim) * normed


def whole_projection_qk_norm(q: torch.Tensor, k: torch.Tensor, q_norm: WholeProjectionNorm,
                             k_norm: WholeProjectionNorm, group) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[..., hq, d]`` and k ``[..., hkv, d]`` (this rank's heads) normalised over the whole projection of each
    token: the mean of squares over every head of every TP rank of ``group`` (None: this rank holds them all)."""
    qf, kf = q.float(), k.float()
    ms = torch.stack([qf.pow(2).mean(dim=(-2, -1)), kf.pow(2).mean(dim=(-2, -1))], dim=-1)
    ms = tp_mean(ms, group)
    qn = qf * torch.rsqrt(ms[..., 0, None, None] + q_norm.eps)
    kn = kf * torch.rsqrt(ms[..., 1, None, None] + k_norm.eps)
    return q_norm.scale(qn.to(q.dtype)), k_norm.scale(kn.to(k.dtype))
