"""The decoder's RMSNorms (transformers' LlamaRMSNorm and its variants), and which one a spec's decoder uses."""

from __future__ import annotations

import torch
from torch import nn

from ..spec import DecoderSpec


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers' LlamaRMSNorm / Qwen2RMSNorm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3-Next / Qwen3.5's RMSNorm: ``x_normed * (1 + w)`` in fp32, then cast (the weight is stored
    zero-centred, as in the checkpoint)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class FP32WeightRMSNorm(RMSNorm):
    """Nemotron-H's RMSNorm: the weight multiplies the fp32 normed input, then the product is cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class PowRMSNorm(RMSNorm):
    """Gemma 4's RMSNorm: ``x * pow(mean(x^2) + eps, -0.5)`` in fp32 (not ``rsqrt``), times the fp32 weight, cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (h * self.weight.float()).type_as(x)


def norm_class(spec: DecoderSpec) -> type[RMSNorm]:
    """The RMSNorm every norm of ``spec``'s decoder uses (the Gated DeltaNet's gated norm aside)."""
    if spec.norm_pow:
        return PowRMSNorm
    if spec.norm_weight_fp32:
        return FP32WeightRMSNorm
    return ZeroCenteredRMSNorm if spec.zero_centered_norm else RMSNorm
