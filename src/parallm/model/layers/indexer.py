"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): for every query, the ``topk`` earlier keys
its layer's multi-head latent attention may see (:mod:`parallm.model.layers.dsa`). Equal to transformers'
``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``::

    q = wq_b(q_resid)                  [.., n, d]   q_resid = q_a_layernorm(q_a_proj(x)), MLA's q latent
    k = LayerNorm(wk(x))               [.., d]      one key head shared by every indexer head
    RoPE on the first rope_dim channels of q and k (interleaved pairs for GLM-5, rotate_half for DeepSeek-V3.2)
    w = weights_proj(x) * n ** -0.5    [.., n]      fp32 (transformers keeps weights_proj in fp32)
    score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j] * d ** -0.5)     fp32, over the keys t may see
    selected[t] = topk(score[t], min(topk, keys))                        torch.topk's rule among ties

Frozen: transformers runs the indexer under ``no_grad``; so does parallm (its parameters have
``requires_grad=False``, table rows ``trained=False``). Training it (DeepSeek's KL objective against the dense
attention) is not implemented.

**Memory linear in S.** The scores are made for a block of queries at a time against the keys the block can see
(its causal window), at most :data:`SCORE_BUDGET` fp32 elements per block, and only the top-k survive: no ``[S,
S]`` tensor. Which keys a query may see is a :class:`KeyRanges` (:func:`key_ranges`), made once per batch from
the layer context: padded rows (causal, real keys only), packed documents, or this rank's chunks under context
parallelism (the gathered sequence's keys before the query, in global order).

**Parallel layouts.** The indexer's weights are replicated over TP (frozen and small: ``n d q_lora + d H + n H``;
splitting its heads would need the ``[queries, keys]`` scores summed over TP before the top-k, communication
quadratic in S). Without sequence parallelism every TP rank computes the same selection (the same inputs, the
same bits). Under sequence parallelism each TP rank scores its own tokens' queries against every token's key
(the keys, ``d`` values a token, all-gathered) and the selections are all-gathered. Under context parallelism the
keys are all-gathered over the CP group and put in global order (:attr:`ContextSplit.order`); each rank scores
its own queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..positions.rope import apply_rope
from .attention import Packing, PaddedRows
from .mla import apply_rope_interleaved

# fp32 score elements (queries x heads x keys) of one block of the indexer
SCORE_BUDGET = 1 << 24

# HF name (after "model.layers.{i}.self_attn.indexer.") -> (parameter of Indexer, DecoderSpec shape attributes)
INDEXER_WEIGHTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "wq_b.weight": ("wq_b", ("index_q_size", "q_lora_rank")),
    "wk.weight": ("wk", ("index_head_dim", "hidden_size")),
    "k_norm.weight": ("k_norm_weight", ("index_head_dim",)),
    "k_norm.bias": ("k_norm_bias", ("index_head_dim",)),
    "weights_proj.weight": ("weights_proj", ("index_n_heads", "hidden_size")),
}
K_NORM_EPS = 1e-6          # transformers builds the indexer's LayerNorm with eps 1e-6


@dataclass
class KeyRanges:
    """Which keys each query may see. Queries are ``rows x width`` activation rows (``[rows, width, ..]``: padded
    ``[S, B]``, packed ``[T, 1]``, a rank's ``[rows, width]`` under context parallelism), keys ``key_rows x width``
    likewise (the whole sequence's under context parallelism, in global order). Query ``(r, w)`` sees key ``(g, w)``
    iff ``lo[r] <= g <= hi[r]`` and ``real[g, w]`` (None: every key real). ``longest``: the most keys any query
    can see, an upper bound (a batch with ``longest <= topk`` selects every visible key: dense attention)."""
    width: int
    lo: list[int]
    hi: list[int]
    key_rows: int
    real: torch.Tensor | None
    longest: int

    @property
    def rows(self) -> int:
        return len(self.lo)


def _ranges_of_pieces(split) -> tuple[list[int], list[int]]:
    """Per local row of a :class:`ContextSplit`: the first and last key row (global order) it sees, from its
    pieces (full pieces: every key; the causal diagonal: up to the query's own)."""
    lo, hi = [0] * split.rows, [-1] * split.rows
    seen = [False] * split.rows
    for p in split.pieces:
        for i in range(p.q1 - p.q0):
            r = p.q0 + i
            last = min(p.k1 - 1, p.k0 + i + p.diag)
            if last < p.k0:
                continue
            lo[r] = p.k0 if not seen[r] else min(lo[r], p.k0)
            hi[r] = last if not seen[r] else max(hi[r], last)
            seen[r] = True
    return lo, hi


def key_ranges(ctx) -> KeyRanges:
    """The :class:`KeyRanges` of a layer context (made once per batch and kept on it): a :class:`PaddedRows`
    (causal within each row, real keys only), a :class:`Packing` (causal within each document of the stream) or
    a :class:`parallm.model.context_parallel.ContextSplit`."""
    cached = getattr(ctx, "_dsa_ranges", None)
    if cached is not None:
        return cached
    if isinstance(ctx, PaddedRows):
        b, s = ctx.keep.shape
        real = None if ctx.full else ctx.keep.transpose(0, 1).contiguous()
        out = KeyRanges(width=b, lo=[0] * s, hi=list(range(s)), key_rows=s, real=real, longest=s)
    elif isinstance(ctx, Packing):
        bounds = ctx.cu_seqlens.tolist()
        lo = [a for a, e in zip(bounds[:-1], bounds[1:]) for _ in range(e - a)]
        out = KeyRanges(width=1, lo=lo, hi=list(range(ctx.total)), key_rows=ctx.total, real=None,
                        longest=ctx.max_seqlen)
    elif hasattr(ctx, "pieces") and hasattr(ctx, "order"):        # a ContextSplit
        lo, hi = _ranges_of_pieces(ctx)
        longest = max((2 * ctx.cp * c for _, c in ctx.segments), default=0)
        out = KeyRanges(width=ctx.width, lo=lo, hi=hi, key_rows=ctx.cp * ctx.rows, real=None, longest=longest)
    else:
        raise TypeError(f"sparse attention needs a PaddedRows, Packing or ContextSplit context, got "
                        f"{type(ctx).__name__}")
    ctx._dsa_ranges = out
    return out


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of ``x`` ``[..., heads, d]`` (the indexer's layout: rotated
    part first, unlike MLA's nope-first heads), interleaved pairs or rotate_half."""
    n = cos.shape[-1]
    rot = apply_rope_interleaved(x[..., :n], cos, sin) if interleave else apply_rope(x[..., :n], cos, sin)
    return torch.cat([rot, x[..., n:]], dim=-1)


# the order key of a masked score (-inf) shifted into the top half of an int64: see topk_lowest_first
_EMPTY_KEY = ((-8388608 ^ 0x7FFFFFFF) + 1) << 32       # -inf's float32 bits (0xFF800000) as ordered, plus one


def topk_lowest_first(scores: torch.Tensor, mask: torch.Tensor, k: int, k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``scores`` ``[.., keys]`` (fp32) among those ``mask`` allows, ties broken by the lower key
    position (``k0 +`` the index along the last dim): one rule in every layout and on every rank, where
    ``torch.topk``'s order among equal values depends on the device, the kernel and the tensor's extent (a
    padded row and the same document in a packed stream scanned different windows and kept different keys among
    tied scores: with few indexer heads, every head's ReLU zero makes exact ties common). Each score becomes one
    int64, its float32 bits made order-preserving (negative values' low 31 bits flipped; -0.0 first made +0.0) in
    the top half and ``2^32 - 1 - position`` in the bottom half, and ``topk`` runs on those. Returns (index along
    the last dim ``[.., k]``, whether the slot holds an allowed key)."""
    bits = (scores + 0.0).masked_fill(~mask, float("-inf")).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() << 32
    pos = torch.arange(k0, k0 + scores.shape[-1], device=scores.device)
    key = ordered + ((1 << 32) - 1 - pos)
    vals, idx = key.topk(k, dim=-1)
    return idx, vals >= _EMPTY_KEY


def select_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ranges: KeyRanges, topk: int, *,
                scale: float, row0: int = 0, budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k keys of each query: q ``[r, width, n, d]`` (queries ``row0 .. row0 + r - 1`` of ``ranges``,
    RoPE applied), k ``[key_rows, width, d]``, w ``[r, width, n]`` fp32 head weights; the products are taken in
    fp32 and multiplied by ``scale`` before the ReLU, as transformers does. Returns ``(index, valid)`` ``[r *
    width, topk]``: each query's selected keys as flat key rows
    (``g * width + w``) and whether each is a key it may see (a query that sees fewer than ``topk`` keys has
    invalid slots; their index is 0). Blocks of queries against their causal window: at most ``budget`` fp32
    scores at a time (None: :data:`SCORE_BUDGET`)."""
    budget = SCORE_BUDGET if budget is None else budget
    r, width, n, _ = q.shape
    index = torch.full((r, width, topk), -1, dtype=torch.int32, device=q.device)
    lo_all = torch.tensor(ranges.lo, dtype=torch.long, device=q.device)
    hi_all = torch.tensor(ranges.hi, dtype=torch.long, device=q.device)
    kf = k.float()
    lo_list, hi_list = ranges.lo, ranges.hi
    a = 0
    while a < r:
        # a block of queries [a, e) whose window of keys [k0, k1) fits the budget (at least one query)
        k0, top, e = lo_list[row0 + a], hi_list[row0 + a], a + 1
        while e < r:
            nk0, ntop = min(k0, lo_list[row0 + e]), max(top, hi_list[row0 + e])
            if (e - a + 1) * n * (ntop + 1 - nk0) > budget:
                break
            k0, top, e = nk0, ntop, e + 1
        k1 = top + 1
        if k1 > k0:
            g = torch.arange(k0, k1, device=q.device)
            lo, hi = lo_all[row0 + a: row0 + e, None], hi_all[row0 + a: row0 + e, None]
            sees = (g[None] >= lo) & (g[None] <= hi)                                   # [blk, keys]
            kk = min(topk, k1 - k0)
            for col in range(width):
                scores = torch.matmul(q[a:e, col].float(), kf[k0:k1, col].transpose(0, 1))   # [blk, n, keys]
                scores = F.relu(scores * scale)
                total = torch.matmul(w[a:e, col].unsqueeze(-2), scores).squeeze(-2)          # [blk, keys]
                mask = sees if ranges.real is None else sees & ranges.real[k0:k1, col][None]
                idx, ok = topk_lowest_first(total, mask, kk, k0)
                index[a:e, col, :kk] = ((idx + k0) * width + col).masked_fill(~ok, -1).int()
        a = e
    return index.view(r * width, topk)


class Indexer(nn.Module):
    """One layer's indexer (see the module docstring): parameters ``wq_b`` ``[n d, q_lora_rank]``, ``wk`` ``[d,
    H]``, ``k_norm_weight`` / ``k_norm_bias`` ``[d]`` (the LayerNorm's) and ``weights_proj`` ``[n, H]`` (fp32 in
    a model of any dtype, as transformers keeps it), replicated over TP, without gradient."""

    def __init__(self, spec, dtype, device=None):
        super().__init__()
        dsa = spec.dsa
        self.n_heads, self.head_dim, self.topk = dsa.n_heads, dsa.head_dim, dsa.topk
        self.rope_dim, self.interleave = dsa.rope_dim, dsa.rope_interleave

        def frozen(*shape, dt=dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)
        self.wq_b = frozen(dsa.n_heads * dsa.head_dim, spec.mla.q_lora_rank)
        self.wk = frozen(dsa.head_dim, spec.hidden_size)
        self.k_norm_weight = frozen(dsa.head_dim)
        self.k_norm_bias = frozen(dsa.head_dim)
        self.weights_proj = frozen(dsa.n_heads, spec.hidden_size, dt=torch.float32)

    def queries_keys(self, x, q_resid, cos, sin):
        """This rank's tokens' indexer queries ``[.., n, d]`` (RoPE'd, model dtype), keys ``[.., d]`` and fp32 head
        weights ``[.., n]`` (``n ** -0.5`` folded in). ``x`` / ``q_resid`` ``[rows, width, ..]``; cos / sin of
        the same rows."""
        q = F.linear(q_resid, self.wq_b).unflatten(-1, (self.n_heads, self.head_dim))
        k = F.layer_norm(F.linear(x, self.wk), (self.head_dim,), self.k_norm_weight, self.k_norm_bias, K_NORM_EPS)
        q = rope_first(q, cos, sin, interleave=self.interleave)
        k = rope_first(k.unsqueeze(-2), cos, sin, interleave=self.interleave).squeeze(-2)
        w = F.linear(x.to(self.weights_proj.dtype), self.weights_proj).float() * self.n_heads ** -0.5
        return q, k, w

    @torch.no_grad()
    def select(self, x, q_resid, cos, sin, ranges: KeyRanges, *, sp_group=None, cp_split=None, cp_group=None):
        """``(index, valid)`` ``[rows * width, topk]`` for every query row of ``ranges`` (:func:`select_topk`).
        ``x`` / ``q_resid``: this rank's tokens (under sequence parallelism, ``sp_group`` given: its ``rows /
        tp`` share of the rows, the selections all-gathered over it); ``cos`` / ``sin``: every row's;
        ``cp_split`` / ``cp_group``: context parallelism (keys all-gathered and put in global order)."""
        from ...parallel.comm import all_gather_single
        rank = 0 if sp_group is None else torch.distributed.get_rank(sp_group)
        mine = x.shape[0]
        row0 = rank * mine
        q, k, w = self.queries_keys(x, q_resid, cos[row0:row0 + mine], sin[row0:row0 + mine])
        k = _gather(k.contiguous(), sp_group, all_gather_single)
        if cp_split is not None:
            k = _gather(k, cp_group, all_gather_single).index_select(0, cp_split.order)
        index = select_topk(q, k, w, ranges, self.topk, row0=row0, scale=self.head_dim ** -0.5)
        return _gather(index, sp_group, all_gather_single)


def _gather(x: torch.Tensor, group, all_gather) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 (rank order), no autograd; ``x`` itself for no group."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return x
    out = x.new_empty((torch.distributed.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather(out, x.contiguous(), group=group)
    return out
