"""The routed experts' activations of ``h = [gate | up]`` (or its halves): SwiGLU keeping only ``h`` for the
backward, gpt-oss's clamped SwiGLU and DeepSeek-V4's clamped SiLU, each op for op as transformers computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["clamped_silu", "clamped_swiglu", "swiglu"]


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``h = [gate | up]`` (the experts' fc1 output, ``[m, 2 w]``), keeping only ``h`` for
    the backward, which writes both halves of the gradient into one ``[m, 2 w]`` tensor (autograd would keep
    ``silu(gate)`` as well, and concatenate the two halves' gradients afterwards). The same operations as
    autograd's, so the same bits in every dtype."""

    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)
        out = F.silu(gate)
        out.mul_(up)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        out = torch.empty_like(h)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad)                                  # d/d up = grad * silu(gate)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)   # d/d gate
        return out


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate | up]`` along the last dim; see :class:`_SwiGLU`."""
    return _SwiGLU.apply(h)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation, transformers' ``GptOssExperts._apply_gate`` op for op (the same bits, forward
    and backward): ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate *
    sigmoid(gate * alpha)``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_silu(gate: torch.Tensor, up: torch.Tensor, *, limit: float) -> torch.Tensor:
    """DeepSeek-V4's expert activation, transformers' ``DeepseekV4Experts._apply_gate`` (and its shared
    ``DeepseekV4MLP``) op for op: ``silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
