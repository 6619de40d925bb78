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
(its causal window), every column of a padded batch at once, and only the top-k survive: no ``[S, S]`` tensor.
Which keys a query may see is a :class:`KeyRanges` (:func:`key_ranges`), made once per batch from the layer
context: padded rows (causal, real keys only), packed documents, or this rank's chunks under context parallelism
(the gathered sequence's keys before the query, in global order). The blocks are planned once per batch
(:mod:`parallm.model.layers.indexer_plan`), each at most a memory budget: half the device's free memory on CUDA
(``PARALLM_INDEXER_MEMORY`` or :data:`SCORE_BUDGET` fix it), so that a 128k-token sequence with 64 indexer heads
takes a few dozen blocks a layer on an 80 GB device, not tens of thousands.

**Ties.** :func:`topk_lowest_first`: among equal scores the lower key position is kept, in every layout and on
every rank (``torch.topk`` keeps whichever tied keys its kernel meets).

**Parallel layouts.** The indexer's weights are replicated over TP (frozen and small: ``n d q_lora + d H + n H``;
splitting its heads would need the ``[queries, keys]`` scores summed over TP before the top-k, communication
quadratic in S). Without sequence parallelism every TP rank computes the same selection (the same inputs, the
same bits). Under sequence parallelism each TP rank scores its own tokens' queries against every token's key
(the keys, ``d`` values a token, all-gathered) and the selections are all-gathered. Under context parallelism the
keys are all-gathered over the CP group and put in global order (:attr:`ContextSplit.order`); each rank scores
its own queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..positions.rope import apply_rope
from .indexer_plan import KeyRanges, key_ranges, pair_bytes  # noqa: F401 - key_ranges re-exported
from .mla import apply_rope_interleaved

# bytes one block of the indexer may take for its scores and their temporaries; None: sized by the device
# (indexer_plan.score_budget: half its free memory on CUDA, PARALLM_INDEXER_MEMORY overriding)
SCORE_BUDGET: int | None = None

# HF name (after "model.layers.{i}.self_attn.indexer.") -> (parameter of Indexer, DecoderSpec shape attributes)
INDEXER_WEIGHTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "wq_b.weight": ("wq_b", ("index_q_size", "q_lora_rank")),
    "wk.weight": ("wk", ("index_head_dim", "hidden_size")),
    "k_norm.weight": ("k_norm_weight", ("index_head_dim",)),
    "k_norm.bias": ("k_norm_bias", ("index_head_dim",)),
    "weights_proj.weight": ("weights_proj", ("index_n_heads", "hidden_size")),
}
K_NORM_EPS = 1e-6          # transformers builds the indexer's LayerNorm with eps 1e-6


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of ``x`` ``[..., heads, d]`` (the indexer's layout: rotated
    part first, unlike MLA's nope-first heads), interleaved pairs or rotate_half."""
    n = cos.shape[-1]
    rot = apply_rope_interleaved(x[..., :n], cos, sin) if interleave else apply_rope(x[..., :n], cos, sin)
    return torch.cat([rot, x[..., n:]], dim=-1)


# the order key of a masked score (-inf) shifted into the top half of an int64: see topk_lowest_first
_EMPTY_KEY = ((-8388608 ^ 0x7FFFFFFF) + 1) << 32       # -inf's float32 bits (0xFF800000) as ordered, plus one


def topk_lowest_first(scores: torch.Tensor, out: torch.Tensor, k: int,
                      rev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``scores`` ``[.., keys]`` (fp32) but those ``out`` excludes, ties broken by the lower key
    position: one rule in every layout and on every rank, where ``torch.topk``'s order among equal values depends
    on the device, the kernel and the tensor's extent (a padded row and the same document in a packed stream
    scanned different windows and kept different keys among tied scores: with few indexer heads, every head's
    ReLU zero makes exact ties common). Each score becomes one int64, its float32 bits made order-preserving
    (negative values' low 31 bits flipped; -0.0 first made +0.0; excluded ones -inf) in the top half and ``rev``
    = ``2^32 - 1 - position`` (int64 ``[keys]``) in the bottom half, and ``topk`` runs on those. Returns (index
    along the last dim ``[.., k]``, whether the slot is empty: fewer than ``k`` keys allowed)."""
    bits = (scores + 0.0).masked_fill_(out, float("-inf")).view(torch.int32)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long().bitwise_left_shift_(32).add_(rev)
    vals, idx = key.topk(k, dim=-1)
    return idx, vals < _EMPTY_KEY


def select_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ranges: KeyRanges, topk: int, *,
                scale: float, row0: int = 0, budget: int | None = None) -> torch.Tensor:
    """The top-k keys of each query: q ``[r, width, n, d]`` (queries ``row0 .. row0 + r - 1`` of ``ranges``,
    RoPE applied), k ``[key_rows, width, d]``, w ``[r, width, n]`` fp32 head weights; the products are taken in
    fp32 and multiplied by ``scale`` before the ReLU, as transformers does. Returns ``[r * width, topk]`` int32:
    each query's selected keys as flat key rows (``g * width + w``), -1 in the slots of a query that sees fewer
    than ``topk`` keys (FlashMLA's form). Ties by the lower key position (:func:`topk_lowest_first`). Blocks of
    queries against their causal window (:meth:`KeyRanges.plan`, made once per batch), each at most ``budget``
    bytes (None: :data:`SCORE_BUDGET`, else the device's :func:`~.indexer_plan.score_budget`, measured once per
    batch), every column of a padded batch at once."""
    r, width, n, d = q.shape
    budget = ranges.budget(q.device, SCORE_BUDGET if budget is None else budget)
    index = torch.full((r, width, topk), -1, dtype=torch.int32, device=q.device)
    lo_all, hi_all = ranges.bounds(q.device)
    unreal = ranges.unreal(q.device)                                     # [width, key_rows] or None
    kf = k.float().permute(1, 2, 0)                                      # [width, d, key_rows]
    pos = torch.arange(ranges.key_rows, device=q.device)
    rev = (1 << 32) - 1 - pos                                            # tie keys: the lower position first
    cols = torch.arange(width, device=q.device)[:, None, None] if width > 1 else None
    for a, e, k0, k1 in ranges.plan(row0, r, pair_bytes(n), budget):
        if k1 <= k0:
            continue
        blk, keys, kk = e - a, k1 - k0, min(topk, k1 - k0)
        g = pos[k0:k1]
        out = (g < lo_all[row0 + a: row0 + e, None]) | (g > hi_all[row0 + a: row0 + e, None])   # [blk, keys]
        if unreal is not None:
            out = out | unreal[:, None, k0:k1]                                               # [width, blk, keys]
        qb = q[a:e].float().transpose(0, 1).reshape(width, blk * n, d)
        scores = torch.bmm(qb, kf[:, :, k0:k1]).mul_(scale).relu_()                      # [width, blk n, keys]
        wb = w[a:e].transpose(0, 1).reshape(width * blk, 1, n)
        total = torch.bmm(wb, scores.view(width * blk, n, keys)).view(width, blk, keys)
        del scores
        idx, empty = topk_lowest_first(total, out, kk, rev[k0:k1])
        idx = idx.add_(k0) if cols is None else idx.mul_(width).add_(k0 * width).add_(cols)  # flat key rows
        index[a:e, :, :kk] = idx.masked_fill_(empty, -1).transpose(0, 1)
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
