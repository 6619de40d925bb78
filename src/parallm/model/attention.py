"""Attention kernels behind one small registry: padded (a boolean mask over ``[B, S]``) and packed / varlen
(causal within each sequence of a packed token stream).

Backends (``build_model(..., attn_impl=...)``):

    sdpa        padded batches: ``scaled_dot_product_attention`` with a boolean mask; any device, any dtype.
    sdpa-loop   packed streams: SDPA (``is_causal=True``) per sequence; any device, any dtype (the CPU path).
    flash-attn  packed streams: ``flash_attn_varlen_func``; needs the flash-attn package, CUDA tensors and
                fp16 / bf16.

``attn_impl="auto"`` picks ``sdpa`` for padded models, and for packed ones ``flash-attn`` where it can run
(package importable, CUDA, half precision) and ``sdpa-loop`` otherwise. The choice is made once, at build,
kept as ``chunk.attn_impl``, logged, and shown by ``parallm inspect``. A new kernel is one :class:`AttnBackend`
entry in :data:`BACKENDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..parallel.state import as_device

try:  # optional CUDA kernel
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _flash_varlen = None


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
    [B, 1, S, S], or None for a batch without padding: plain causal attention (``is_causal``), no S x S mask,
    which lets SDPA pick its flash / memory-efficient kernels."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=1.0 / math.sqrt(q.shape[-1]), enable_gqa=k.shape[1] != q.shape[1])


def sdpa_loop_varlen(q, k, v, packing: Packing):
    """q: [T, hq, d]; k, v: [T, hkv, d]. Causal attention within each segment of ``packing.cu_seqlens``."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    bounds = packing.cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, L, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0 / math.sqrt(d),
                                           enable_gqa=hkv != hq)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def flash_varlen(q, k, v, packing: Packing):
    cu = packing.cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _flash_varlen(q, k, v, cu, cu, packing.max_seqlen, packing.max_seqlen, causal=True)


# -- blocks with their log-sum-exp (context parallelism) --------------------------------------------------------
#
# A block is a run of queries against a run of keys that is either entirely visible to them or the square causal
# diagonal (query i sees keys <= i): with compacted, zigzag-split sequences every piece of context-parallel
# attention is one of the two, so no mask tensor is ever built.

def _scores(q, k, causal: bool, scale):
    """fp32 ``q k^T * scale`` ``[W, hkv, g, Lq, Lk]`` for q ``[W, hq, Lq, d]``, k ``[W, hkv, Lk, d]`` (query head
    ``h`` uses key head ``h // g``); ``causal``: a square block, keys after the query at -inf."""
    w, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = torch.matmul(q.reshape(w, hkv, g * lq, d), k.transpose(-1, -2)).mul_(scale).view(w, hkv, g, lq, -1)
    if causal:
        s.masked_fill_(torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return s


def block_forward(q, k, v, causal: bool, scale):
    """One block of attention in fp32: ``(out [W, hq, Lq, d], lse [W, hq, Lq])``, the log-sum-exp of the scaled
    scores of each query over this block's visible keys."""
    w, hq, lq, d = q.shape
    hkv = k.shape[1]
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p.view(w, hkv, -1, k.shape[2]), v).view(w, hq, lq, d)
    return out, lse.view(w, hq, lq)


def block_backward(q, k, v, out, lse, grad, causal: bool, scale):
    """Gradients ``(dq, dk, dv)`` (fp32) of one block from the *final* output and log-sum-exp of its queries
    (``P = exp(S - lse)`` is then this block's share of the whole softmax): ``dV = P^T dO``,
    ``dS = P (dO V^T - rowsum(dO O))``, ``dQ = dS K scale``, ``dK = dS^T Q scale``."""
    w, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.view(w, hkv, g, lq, 1)).view(w, hkv, g * lq, lk)
    do = grad.reshape(w, hkv, g * lq, d)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    delta = (grad * out).sum(-1).reshape(w, hkv, g * lq, 1)
    ds = p.mul_(dp.sub_(delta))
    dq = torch.matmul(ds, k).mul_(scale).view(w, hq, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(w, hkv, g * lq, d)).mul_(scale)
    return dq, dk, dv


def cpu_block_forward(q, k, v, causal: bool, scale):
    """:func:`block_forward` by the CPU's fused flash-attention kernel (``aten._scaled_dot_product_flash_attention_
    for_cpu``, which returns the log-sum-exp; grouped-query heads as they are): the same values to fp32
    rounding, without the ``[Lq, Lk]`` scores of every head in memory at once."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def cpu_block_backward(q, k, v, out, lse, grad, causal: bool, scale):
    """:func:`block_backward` by the CPU's fused flash-attention backward (from the final output and lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


@dataclass(frozen=True)
class BlockKernel:
    """Attention over one block of keys that also returns the log-sum-exp, and its backward from the final output
    and log-sum-exp (what merging partial results needs): fp32 ``q [W, hq, Lq, d]``, ``k, v [W, hkv, Lk, d]``,
    ``causal``: the block is the square causal diagonal (else every key is visible)."""
    name: str
    forward: Callable
    backward: Callable


MATH_BLOCK = BlockKernel("math", block_forward, block_backward)
CPU_FLASH_BLOCK = BlockKernel("cpu-flash", cpu_block_forward, cpu_block_backward)


def block_kernel(backend: "AttnBackend | None", device) -> BlockKernel:
    """The block kernel context parallelism runs for a model of ``backend`` on ``device``: the backend's own when
    it has one, else the CPU's fused kernel on CPU and the explicit fp32 one elsewhere."""
    if backend is not None and backend.block is not None:
        return backend.block
    return CPU_FLASH_BLOCK if as_device(device).type == "cpu" else MATH_BLOCK


@dataclass(frozen=True)
class AttnBackend:
    """One attention kernel: ``packed`` says which input it takes (a :class:`Packing` stream or a padded batch
    with a boolean mask); ``unavailable(device, dtype)`` returns why it cannot run there, or None; ``block``: its
    :class:`BlockKernel` for context parallelism (None: :func:`block_kernel`'s default for the device;
    a fused GPU kernel returning the log-sum-exp, such as flash-attn's, plugs in here)."""
    name: str
    packed: bool
    fn: Callable
    unavailable: Callable[[torch.device, torch.dtype], str | None] = lambda device, dtype: None
    block: BlockKernel | None = None


def _flash_unavailable(device, dtype):
    if _flash_varlen is None:
        return "the flash-attn package is not installed"
    if as_device(device).type != "cuda":
        return f"it needs CUDA tensors (the model is on {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 / bfloat16 (the model is {dtype})"
    return None


BACKENDS: dict[str, AttnBackend] = {b.name: b for b in (
    AttnBackend("sdpa", packed=False, fn=padded_attention),
    AttnBackend("sdpa-loop", packed=True, fn=sdpa_loop_varlen),
    AttnBackend("flash-attn", packed=True, fn=flash_varlen, unavailable=_flash_unavailable),
)}
AUTO_ORDER = {False: ("sdpa",), True: ("flash-attn", "sdpa-loop")}


def resolve_attn_impl(attn_impl: str, *, packed: bool, device, dtype) -> AttnBackend:
    """The backend a model built with ``attn_impl`` (a name in :data:`BACKENDS` or "auto") runs; a name that
    does not fit the model (padded vs packed) or cannot run on its device / dtype is a ValueError saying why."""
    if attn_impl == "auto":
        for name in AUTO_ORDER[packed]:
            if BACKENDS[name].unavailable(device, dtype) is None:
                return BACKENDS[name]
    if attn_impl not in BACKENDS:
        raise ValueError(f"attn_impl must be 'auto' or one of {sorted(BACKENDS)}, got {attn_impl!r}")
    backend = BACKENDS[attn_impl]
    if backend.packed != packed:
        fits = sorted(n for n, b in BACKENDS.items() if b.packed == packed)
        raise ValueError(f"attn_impl={attn_impl!r} is a {'packed' if backend.packed else 'padded'} kernel; a "
                         f"{'packed' if packed else 'padded'} model runs one of {fits}")
    why = backend.unavailable(device, dtype)
    if why is not None:
        raise ValueError(f"attn_impl={attn_impl!r} cannot run here: {why}")
    return backend
