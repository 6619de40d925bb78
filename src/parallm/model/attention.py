"""Attention kernels: padded (SDPA with a boolean mask) and packed / varlen (causal within each sequence).

Varlen backends, chosen automatically per call:
    flash-attn  ``flash_attn_varlen_func`` when the package imports, tensors are on CUDA and fp16/bf16;
    sdpa-loop   ``scaled_dot_product_attention(is_causal=True)`` per sequence: any device, any dtype (the CPU
                path, and the fp32 fallback on GPU).
``LAST_BACKEND`` records which one ran last (tests and the GPU smoke script read it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # optional CUDA kernel
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _flash_varlen = None

LAST_BACKEND = {"varlen": None}


@dataclass
class Packing:
    """How a padded ``[B, S]`` batch maps to the packed token stream ``[T]``.

    ``indices``: flat positions (into B*S) of the real tokens, row by row; ``nnz`` of them. The stream is padded
    to ``total`` tokens (a multiple of tp under sequence parallelism); the padding forms its own segment.
    ``cu_seqlens``: segment boundaries in the stream (int32, starts with 0, ends with ``total``).
    """
    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    nnz: int
    total: int
    batch: int
    seq: int


def make_packing(attention_mask: torch.Tensor, multiple: int = 1) -> Packing:
    b, s = attention_mask.shape
    flat = attention_mask.reshape(-1).bool()
    indices = flat.nonzero(as_tuple=False).squeeze(-1)
    lengths = attention_mask.bool().sum(-1)
    lengths = lengths[lengths > 0]
    nnz = int(indices.numel())
    total = -(-max(nnz, 1) // multiple) * multiple
    seg = lengths.tolist() + ([total - nnz] if total > nnz else [])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32, device=attention_mask.device)
    cu[1:] = torch.tensor(seg, dtype=torch.int32, device=attention_mask.device).cumsum(0)
    return Packing(indices=indices, cu_seqlens=cu, max_seqlen=max(seg) if seg else 0, nnz=nnz, total=total,
                   batch=b, seq=s)


def pack_tokens(x: torch.Tensor, packing: Packing, fill=0) -> torch.Tensor:
    """``[B, S]`` -> ``[T]`` (real tokens in order, then ``fill`` up to ``total``)."""
    flat = x.reshape(-1)[packing.indices]
    if packing.total > packing.nnz:
        flat = torch.cat([flat, flat.new_full((packing.total - packing.nnz,), fill)])
    return flat


def unpack_tokens(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """``[T, ...]`` -> ``[S, B, ...]`` with zeros at padded positions (differentiable)."""
    rest = tuple(x.shape[1:])
    out = x.new_zeros((packing.batch * packing.seq,) + rest)
    out = out.index_put((packing.indices,), x[:packing.nnz])
    return out.reshape((packing.batch, packing.seq) + rest).transpose(0, 1)


def padded_attention(q, k, v, mask):
    """q: [B, hq, S, d]; k, v: [B, hkv, S, d] (grouped-query: hq a multiple of hkv); mask: boolean
    [B, 1, S, S]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
                                          enable_gqa=k.shape[1] != q.shape[1])


def varlen_attention(q, k, v, packing: Packing):
    """q: [T, hq, d]; k, v: [T, hkv, d]. Causal attention within each segment of ``packing.cu_seqlens``."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    if _flash_varlen is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        LAST_BACKEND["varlen"] = "flash-attn"
        cu = packing.cu_seqlens.to(device=q.device, dtype=torch.int32)
        return _flash_varlen(q, k, v, cu, cu, packing.max_seqlen, packing.max_seqlen, causal=True)
    LAST_BACKEND["varlen"] = "sdpa-loop"
    bounds = packing.cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, L, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0 / math.sqrt(d),
                                           enable_gqa=hkv != hq)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)
