"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), equal to transformers' ``DeepseekV4HyperConnection``
and ``DeepseekV4HyperHead``.

The residual stream of a V4 decoder is ``n = hc_mult`` streams of the hidden size, ``[.., n, H]``. Before a block
(attention or the MoE), a learned projection of the RMS-normed, flattened streams (``fn [(2 + n) n, n H]``, plus
``base``, times the three ``scale`` factors) gives per token

* ``pre [n]``: ``sigmoid(.) + eps``, the weights that collapse the streams into the block's input ``sum_j pre_j
  x_j``;
* ``post [n]``: ``2 sigmoid(.)``, how the block's output is spread back over the streams;
* ``comb [n, n]``: a softmax made doubly stochastic by ``sinkhorn_iters`` Sinkhorn-Knopp steps (column
  normalisation first, then ``iters - 1`` row / column pairs, each denominator plus ``eps``), which mixes the
  input streams into the output ones: ``out_k = post_k * block + sum_j comb[j, k] x_j``.

The projection, the norm and the three mixing weights are computed in fp32 (transformers keeps these modules in
fp32), the collapse and the mix in the activations' dtype as transformers casts them. The last stage collapses
the streams once more with its own ``pre`` weights (:class:`HyperHead`, no ``post`` / ``comb``) before the final
norm.

Between layers parallm keeps the streams flattened, ``[S, B, n H]`` (``[T, 1, n H]`` packed, split over TP
under sequence parallelism, a CP rank's share under context parallelism): every operation here is per token, so
every layout and the pipeline's send / receive carry the streams as a wider hidden state. The parameters are
replicated on every TP rank (their gradients summed over TP under sequence parallelism, as the norms').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4UnweightedRMSNorm`` (``x`` fp32 here)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb [.., n, n]`` (positive) made doubly stochastic as transformers does it: one column normalisation,
    then ``iters - 1`` row-then-column normalisations, each denominator plus ``eps``."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mixing weights (``attn_hc`` / ``ffn_hc``): ``fn``, ``base``, ``scale``, all fp32."""

    def __init__(self, hidden: int, n: int, *, sinkhorn_iters: int, eps: float, norm_eps: float, device=None):
        super().__init__()
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * hidden, dtype=torch.float32, device=device))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32, device=device))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32, device=device))
        self.recompute = False      # build_model(recompute="moe" / "selective"): keep the streams (recomputed)

    def forward(self, streams: torch.Tensor):
        """``streams [.., n, H]`` -> ``(post [.., n], comb [.., n, n], collapsed [.., H])`` (post / comb fp32,
        collapsed in the streams' dtype)."""
        return recomputed(self._mix, streams) if self.recompute else self._mix(streams)

    def _mix(self, streams: torch.Tensor):
        n = self.n
        flat = _unweighted_rms(streams.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.sinkhorn_iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


CHUNK_ELEMENTS = 1 << 21     # stream elements a recomputed piece covers (8 MiB in fp32): see recomputed


def recomputed(fn, streams: torch.Tensor):
    """``fn(streams)`` keeping only ``streams`` (which the stream mix after the block keeps anyway) for the
    backward (``build_model(recompute="moe" / "selective")``): ``fn`` runs under ``torch.utils.checkpoint``
    (non-reentrant) on pieces of at most :data:`CHUNK_ELEMENTS` along the first (token) dimension, its outputs
    concatenated. What is not kept: the RMS-normed flattened streams ``[.., n H]`` fp32 the projection saves
    (``[S, 4 H]`` in V4-Flash, per hyper-connection). Every operation is per token; the backward's temporaries
    (six or so stream-sized tensors) are those of one piece. One piece is bit for bit the whole; several are
    not: a piece's small GEMM may round differently from the whole's, the parameters' gradients are sums over the
    pieces, and the streams' gradient gets the pieces' terms (norm and collapse) already summed before the stream
    mix's joins them (another association): within ~1e-6 relative (tests/test_recompute_selective.py)."""
    if not torch.is_grad_enabled():
        return fn(streams)
    step = max(1, CHUNK_ELEMENTS // max(1, streams[:1].numel()))
    if step >= streams.shape[0]:        # one piece: the very graph of fn(streams), its saved tensors recomputed
        return checkpoint(fn, streams, use_reentrant=False, preserve_rng_state=False)
    parts = [checkpoint(fn, piece, use_reentrant=False, preserve_rng_state=False)
             for piece in streams.split(step, 0)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, 0)
    return tuple(torch.cat(p, 0) for p in zip(*parts))


def mix_streams(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """``out_k = post_k * block_out + sum_j comb[j, k] streams_j`` in the streams' dtype: ``streams [.., n, H]``,
    ``block_out [.., H]``."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)


class HyperHead(nn.Module):
    """The last stage's collapse of the streams before the final norm (``hc_head``: ``hc_fn [n, n H]``,
    ``hc_base [n]``, ``hc_scale [1]``, fp32). Takes and returns the flattened layout: ``[.., n H] -> [.., H]``."""

    def __init__(self, hidden: int, n: int, *, eps: float, norm_eps: float, device=None):
        super().__init__()
        self.n, self.hidden, self.eps, self.norm_eps = n, hidden, eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32, device=device))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32, device=device))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device))
        self.recompute = False      # as HyperConnection's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._collapse, x) if self.recompute else self._collapse(x)

    def _collapse(self, x: torch.Tensor) -> torch.Tensor:
        streams = x.unflatten(-1, (self.n, self.hidden))
        mixes = F.linear(_unweighted_rms(x.float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(x.dtype)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """The embeddings ``[.., H]`` copied into ``n`` streams, flattened: ``[.., n H]``."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).flatten(-2)
