"""The union path of the sparse latent attention (:mod:`parallm.model.layers.dsa`): a block of queries attends
to the *union* of the key rows its queries select, by one dense matmul masked per query, instead of gathering
every query's own rows.

The gathered path copies ``b x k`` key rows of ``D`` values for a block of ``b`` queries with ``k`` slots each
and multiplies each query's ``h`` heads by its own rows: with few heads (DeepSeek-V4: 8 a rank at most, one
key = value head of 512) the copy and the thin batched products dominate. When the queries of a block share
their keys (V4's sliding windows overlap; below ``index_topk`` compressed keys every query of a document sees
every earlier entry), the union of their rows is hardly larger than one query's: ``[b h, D] x [D, union]`` is
one well-shaped matmul, the union's rows are gathered once, and the mask (which union rows each query selected)
is ``[b, union]``. The same keys, the same fp32 softmax and log-sum-exp: equal to the gathered path to
rounding (the dot products' summation order).

:func:`union_of` decides per block: the union is used when it has at most :data:`UNION_RATIO` times the slots
of one query and no query selects a row twice (the gathered path would count it twice); the backward makes the
same decision from the same index. Memory per block: the union's rows and ``[b, h, union]`` scores, with ``b``
at most :data:`UNION_ROWS` queries; nothing is kept for the backward beyond what the gathered path keeps.
"""

from __future__ import annotations

import torch

UNION_ROWS = 64          # queries per block on the union path
UNION_RATIO = 2.0        # the union path when a block's union has at most this many times one query's slots


def union_of(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows [u] long, mask [b, u] bool)`` of a block's selection ``index`` ``[b, k]`` (int32, -1: empty): the
    sorted distinct key rows it names and which of them each query selected; None where the gathered path is
    better (a union wider than :data:`UNION_RATIO` x k) or needed (a query naming a row twice)."""
    valid = index >= 0
    rows = torch.unique(index[valid]).long()
    if rows.numel() > UNION_RATIO * max(index.shape[1], 1):
        return None
    b = index.shape[0]
    pos = torch.searchsorted(rows, index.long().clamp_min(0))
    mask = torch.zeros(b, rows.numel() + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(1, torch.where(valid, pos, rows.numel()), True)        # empty slots: the extra column
    mask = mask[:, :-1]
    if int(mask.sum()) != int(valid.sum()):                            # a row selected twice by one query
        return None
    return rows, mask


def union_forward(q, kv, rows, mask, scale: float, dv: int):
    """One block on the union path: q ``[b, h, D]``, the key rows ``kv`` ``[N, D]`` -> (out ``[b, h, dv]``
    fp32, lse ``[b, h]`` fp32; -inf and zeros for a query that selected nothing)."""
    keys = kv.index_select(0, rows).float()                                      # [u, D]
    scores = torch.matmul(q.float(), keys.t()) * scale                           # [b, h, u]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    den = p.sum(-1, keepdim=True)
    out = torch.matmul(p, keys[:, :dv]) / den.clamp_min(torch.finfo(torch.float32).tiny)
    return out, (m + torch.log(den)).squeeze(-1)


def union_backward(q, kv, rows, mask, out, lse, g, scale: float, dv: int):
    """The gradients of one union block from its fp32 ``out`` / ``lse`` (the sink-corrected ones: the sink only
    moves the denominator) and the output's gradient ``g`` ``[b, h, dv]`` fp32: (dq ``[b, h, D]`` fp32, the
    union rows' gradient ``[u, D]`` fp32, to be added at ``rows``)."""
    keys = kv.index_select(0, rows).float()
    qb = q.float()
    b, h, d = qb.shape
    scores = (torch.matmul(qb, keys.t()) * scale).masked_fill(~mask[:, None, :], float("-inf"))
    base = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - base[..., None])                                      # [b, h, u]
    dp = torch.matmul(g, keys[:, :dv].t())
    delta = (g * out).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, keys)
    dkeys = ds.reshape(b * h, -1).t() @ qb.reshape(b * h, d)                     # [u, D]
    dkeys[:, :dv] += p.reshape(b * h, -1).t() @ g.reshape(b * h, dv)
    return dq, dkeys
