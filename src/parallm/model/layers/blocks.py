"""Attention over pieces: a run of queries against a run of keys with a band of visible pairs (context
parallelism, sliding windows), merged by log-sum-exp in fp32, and the block kernels that compute them (the CPU's
fused flash kernel over tiles, an explicit fp32 one, aten's varlen flash attention on CUDA).

Attention that is not one plain causal run per sequence (a rank's chunks against the whole sequence's keys under
context parallelism; sliding windows, packed or padded) is cut into pieces. A piece's result comes with the
log-sum-exp of its scores, and the pieces of a query are merged by log-sum-exp in fp32: no [queries, keys] mask or
score tensor of a whole sequence is ever built. A kernel call covers a whole list of pieces (every document of a
packed batch, every row of a padded one): the number of calls per layer does not grow with the number of
documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...parallel.state import as_device
from .pieces import (MAX_TILE, TILE_BUDGET, Piece, PiecePlan, _every_pair_visible, _Tiles,  # noqa: F401
                     clip_piece)


def _gather_tiles(x, index, pad=None):
    """``x [n, h, d]`` rows at ``index [m, T]`` -> fp32 ``[m, h, T, d]`` (a view of the one gathered copy). A
    tile row of index -1 (none) reads row 0 instead, with no copy of ``x`` made to give it a row of its own: its
    value is never seen (a query row's results are dropped, a key row is masked out: -inf scores, so exactly zero
    weight and exactly zero gradients); ``pad`` (``index < 0``) zeroes those rows of the gathered copy where the
    backward needs them zero (a row that is no query adds nothing)."""
    t = x[index.clamp(min=0)].float()
    if pad is not None:
        t.masked_fill_(pad.view(pad.shape + (1,) * (t.dim() - 2)), 0.0)
    return t.permute(0, 2, 1, 3)


def tiles_forward(block_fwd, q, k, v, plan: PiecePlan, scale):
    """A plan's pieces by a block kernel over tiles, in fp32 (one ``block_fwd`` call per :data:`TILE_BUDGET` of
    scores, full and banded tiles apart): ``(rows [E], out [E, hq, d], lse [E, hq])``, a query row's partial
    results once per tile it is in (merge them with :func:`merge_rows`). q ``[R, hq, d]``, k / v ``[K, hkv, d]``.
    Only the tiles are copied (gathered, in fp32): full tiles hold no missing key (``_Tiles``), banded ones mask
    theirs."""
    tiles = plan.tiles(q.device)
    hq, d = q.shape[1], q.shape[2]
    rows, outs, lses = [], [], []
    for g, masked in tiles.groups(hq):
        qi, ki, mask, any_key = tiles.build(g, masked)
        o, lse = block_fwd(_gather_tiles(q, qi), _gather_tiles(k, ki), _gather_tiles(v, ki), False, scale, mask=mask)
        lse = lse.masked_fill(~any_key[:, None, :], float("-inf"))       # a row that saw nothing here
        keep = (qi.reshape(-1) >= 0).nonzero().squeeze(-1)
        rows.append(qi.reshape(-1).index_select(0, keep))
        outs.append(o.permute(0, 2, 1, 3).reshape(-1, hq, d).index_select(0, keep))
        lses.append(lse.permute(0, 2, 1).reshape(-1, hq).index_select(0, keep))
    if not outs:
        return (torch.zeros(0, dtype=torch.long, device=q.device), q.new_zeros((0, hq, d), dtype=torch.float32),
                q.new_zeros((0, hq), dtype=torch.float32))
    return torch.cat(rows), torch.cat(outs), torch.cat(lses)


def tiles_backward(block_bwd, q, k, v, out, lse, grad, plan: PiecePlan, scale, dq, dk, dv) -> None:
    """The gradients of :func:`tiles_forward`'s pieces from the final (merged) ``out [R, hq, d]`` / ``lse [R, hq]``
    of every query row, added into the fp32 ``dq`` / ``dk`` / ``dv`` (shaped like q / k / v) in place. A tile row
    that is no query gets q, lse and the output's gradient zero (:func:`_gather_tiles`' ``pad``), so it adds
    exactly zero to every gradient; a missing key row is masked (exactly zero weight): their exact zeros are added
    into row 0, which leaves it unchanged."""
    tiles = plan.tiles(q.device)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    lz = lse.masked_fill(torch.isinf(lse), 0.0)[..., None]
    for g, masked in tiles.groups(hq):
        qi, ki, mask, _ = tiles.build(g, masked)
        pad = qi < 0
        gdq, gdk, gdv = block_bwd(_gather_tiles(q, qi, pad), _gather_tiles(k, ki), _gather_tiles(v, ki),
                                  _gather_tiles(out, qi), _gather_tiles(lz, qi, pad)[..., 0],
                                  _gather_tiles(grad, qi, pad), False, scale, mask=mask)
        qr, kr = qi.reshape(-1).clamp(min=0), ki.reshape(-1).clamp(min=0)
        dq.index_add_(0, qr, gdq.permute(0, 2, 1, 3).reshape(-1, hq, d))
        dk.index_add_(0, kr, gdk.permute(0, 2, 1, 3).reshape(-1, hkv, d))
        dv.index_add_(0, kr, gdv.permute(0, 2, 1, 3).reshape(-1, hkv, d))


def merge_rows(acc: torch.Tensor, acc_lse: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Fold partial results ``out [E, hq, d]`` / ``lse [E, hq]`` of query rows ``rows [E]`` (a row may repeat)
    into the fp32 accumulators ``acc [R, hq, d]`` / ``acc_lse [R, hq]`` in place: the softmax over the union of
    the keys each part saw (a row no part covers keeps zeros and -inf)."""
    if rows.numel() == 0:
        return
    m = acc_lse.scatter_reduce(0, rows[:, None].expand_as(lse), lse, "amax")
    m = m.masked_fill(torch.isinf(m), 0.0)
    old = torch.exp(acc_lse - m)
    w = torch.exp(lse - m.index_select(0, rows))
    den = old.index_add(0, rows, w)
    acc.mul_(old.unsqueeze(-1)).index_add_(0, rows, out * w.unsqueeze(-1))
    acc.div_(den.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    acc_lse.copy_(m + den.log())


def _scores(q, k, causal: bool, scale, mask=None):
    """fp32 ``q k^T * scale`` ``[W, hkv, g, Lq, Lk]`` for q ``[W, hq, Lq, d]``, k ``[W, hkv, Lk, d]`` (query head
    ``h`` uses key head ``h // g``); ``causal``: a square block, keys after the query at -inf; ``mask``: an
    additive ``[W, 1, Lq, Lk]`` (0 / -inf)."""
    w, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = torch.matmul(q.reshape(w, hkv, g * lq, d), k.transpose(-1, -2)).mul_(scale).view(w, hkv, g, lq, -1)
    if causal:
        s.masked_fill_(torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if mask is not None:
        s.add_(mask.view(w, 1, 1, lq, k.shape[2]))
    return s


def block_forward(q, k, v, causal: bool, scale, mask=None):
    """One block of attention in fp32: ``(out [W, hq, Lq, d], lse [W, hq, Lq])``, the log-sum-exp of the scaled
    scores of each query over this block's visible keys (-inf, and a zero output, for a query that sees none)."""
    w, hq, lq, d = q.shape
    hkv = k.shape[1]
    s = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    out = torch.matmul(p.view(w, hkv, -1, k.shape[2]), v).view(w, hq, lq, d)
    return out, lse.view(w, hq, lq)


def block_backward(q, k, v, out, lse, grad, causal: bool, scale, mask=None):
    """Gradients ``(dq, dk, dv)`` (fp32) of one block from the *final* output and log-sum-exp of its queries
    (``P = exp(S - lse)`` is then this block's share of the whole softmax): ``dV = P^T dO``,
    ``dS = P (dO V^T - rowsum(dO O))``, ``dQ = dS K scale``, ``dK = dS^T Q scale``."""
    w, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    s = _scores(q, k, causal, scale, mask)
    p = torch.exp(s - lse.view(w, hkv, g, lq, 1)).view(w, hkv, g * lq, lk)
    do = grad.reshape(w, hkv, g * lq, d)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    delta = (grad * out).sum(-1).reshape(w, hkv, g * lq, 1)
    ds = p.mul_(dp.sub_(delta))
    dq = torch.matmul(ds, k).mul_(scale).view(w, hq, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.reshape(w, hkv, g * lq, d)).mul_(scale)
    return dq, dk, dv


def cpu_block_forward(q, k, v, causal: bool, scale, mask=None):
    """:func:`block_forward` by the CPU's fused flash-attention kernel (``aten._scaled_dot_product_flash_attention_
    for_cpu``, which returns the log-sum-exp; grouped-query heads as they are; ``mask``: additive fp32): the same
    values to fp32 rounding, without the ``[Lq, Lk]`` scores of every head in memory at once. It has no window
    of its own: :func:`tiles_forward` gives it each tile's band as ``mask``. A query that sees no key gets a zero
    output and a log-sum-exp of 0 from it (the tile kernels set -inf there)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def cpu_block_backward(q, k, v, out, lse, grad, causal: bool, scale, mask=None):
    """:func:`block_backward` by the CPU's fused flash-attention backward (from the final output and lse)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               attn_mask=mask, scale=scale)


# -- CUDA: aten's flash-attention (varlen, windowed, returns the log-sum-exp) ------------------------------------
#
# torch.ops.aten._flash_attention_forward with cumulative sequence lengths takes q [total_q, hq, d], k / v
# [total_k, hkv, d] (grouped-query heads as they are), aligns causal masks and windows to the bottom right of
# each sequence (query i of Lq sees key j of Lk iff i + Lk - Lq - left <= j <= i + Lk - Lq + right; -1: unbounded),
# and returns the log-sum-exp as [hq, total_q] fp32. It runs fp16 / bf16 on sm80+ with head_dim a multiple of 8
# up to 256. A piece whose band is the causal edge at the bottom right (``diag == k1 - k0 - (q1 - q0)``: every
# causal diagonal, every piece of a packed sequence under a window) or that sees every key goes there, all such
# pieces of a plan in one call per kind; the rest (a piece of another rank's chunk cut by a window) and other
# dtypes go through the fp32 tiles of :func:`block_forward`.

@dataclass
class _FlashGroup:
    causal: bool
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _flash_split(plan: PiecePlan, device):
    """(flash groups: causal-at-the-bottom-right, every key visible; the plan of the other pieces)."""
    def make():
        groups, rest = {True: [], False: []}, []
        for p in plan.pieces:
            if p.diag == (p.k1 - p.k0) - (p.q1 - p.q0):
                groups[True].append(p)
            elif _every_pair_visible(p, plan.window):
                groups[False].append(p)
            else:
                rest.append(p)
        out = []
        for causal, pieces in groups.items():
            if not pieces:
                continue
            qi, ki, lq, lk = [], [], [], []
            for p in pieces:
                for w in range(plan.width):
                    qi.append(torch.arange(p.q0, p.q1) * plan.width + w)
                    ki.append(torch.arange(p.k0, p.k1) * plan.width + w)
                    lq.append(p.q1 - p.q0)
                    lk.append(p.k1 - p.k0)
            cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
            out.append(_FlashGroup(causal, torch.cat(qi).to(device), torch.cat(ki).to(device), cu_q.to(device),
                                   cu_k.to(device), max(lq), max(lk)))
        return out, PiecePlan(rest, width=plan.width, window=plan.window)
    return plan.cached(("flash", str(device)), make)


def cuda_flash_usable(q: torch.Tensor) -> bool:
    """Whether aten's flash-attention kernel takes ``q``: CUDA, fp16 / bf16, head_dim a multiple of 8 up to 256,
    compute capability 8.0 or newer."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _flash_window(group: _FlashGroup, window):
    """flash's window for a group: causal ones ``(window - 1, 0)`` (keys ``i - window < j <= i`` at the bottom
    right); the group of pieces that see every key none."""
    if not group.causal:
        return dict(window_size_left=None, window_size_right=None)
    return dict(window_size_left=window - 1 if window is not None else None, window_size_right=0)


def flash_forward(q, k, v, g: _FlashGroup, scale, window):
    """aten's varlen flash forward over one group: ``(out [Tq, hq, d], lse [hq, Tq] fp32)``."""
    return torch.ops.aten._flash_attention_forward(q, k, v, g.cu_q, g.cu_k, g.max_q, g.max_k, 0.0, g.causal, False,
                                                   scale=scale, **_flash_window(g, window))[:2]


def flash_backward(grad, q, k, v, out, lse, g: _FlashGroup, scale, window):
    """aten's varlen flash backward over one group from the final ``out`` (q's dtype) and ``lse [hq, Tq]``:
    ``(dq, dk, dv)`` shaped like q, k, v (grouped-query heads summed by the kernel). Dropout is 0, so the RNG
    state it takes is not read: zeros of the shapes the forward returns."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, g.cu_q, g.cu_k, g.max_q, g.max_k, 0.0,
                                                    g.causal, seed, offset, scale=scale, **_flash_window(g, window))


def cuda_run(q, k, v, plan: PiecePlan, scale):
    """:attr:`BlockKernel.run` on CUDA (see the notes above :class:`_FlashGroup`)."""
    if not cuda_flash_usable(q):
        return tiles_forward(block_forward, q, k, v, plan, scale)
    groups, rest = _flash_split(plan, q.device)
    rows, outs, lses = [], [], []
    for g in groups:
        o, lse = flash_forward(q.index_select(0, g.q_index), k.index_select(0, g.k_index),
                               v.index_select(0, g.k_index), g, scale, plan.window)
        rows.append(g.q_index)
        outs.append(o.float())
        lses.append(lse.t())
    if rest.pieces:
        r, o, lse = tiles_forward(block_forward, q, k, v, rest, scale)
        rows.append(r)
        outs.append(o)
        lses.append(lse)
    return torch.cat(rows), torch.cat(outs), torch.cat(lses)


def cuda_run_backward(q, k, v, out, lse, grad, plan: PiecePlan, scale, dq, dk, dv) -> None:
    """:attr:`BlockKernel.run_backward` on CUDA: aten's flash backward from the final output (in q's dtype) and
    log-sum-exp of the rows of each group; the rest through the fp32 tiles."""
    if not cuda_flash_usable(q):
        return tiles_backward(block_backward, q, k, v, out, lse, grad, plan, scale, dq, dk, dv)
    groups, rest = _flash_split(plan, q.device)
    for g in groups:
        gq, gk, gv = q.index_select(0, g.q_index), k.index_select(0, g.k_index), v.index_select(0, g.k_index)
        go = out.index_select(0, g.q_index).to(q.dtype)
        gl = lse.index_select(0, g.q_index).t().contiguous()
        gg = grad.index_select(0, g.q_index).to(q.dtype)
        gdq, gdk, gdv = flash_backward(gg, gq, gk, gv, go, gl, g, scale, plan.window)
        dq.index_add_(0, g.q_index, gdq.float())
        dk.index_add_(0, g.k_index, gdk.float())
        dv.index_add_(0, g.k_index, gdv.float())
    if rest.pieces:
        tiles_backward(block_backward, q, k, v, out, lse, grad, rest, scale, dq, dk, dv)


@dataclass(frozen=True)
class BlockKernel:
    """Attention over blocks of keys that also returns the log-sum-exp, and its backward from the final output
    and log-sum-exp (what merging partial results needs).

    ``forward`` / ``backward``: one block, fp32 ``q [W, hq, Lq, d]``, ``k, v [W, hkv, Lk, d]``, ``causal`` (the
    square causal diagonal, else every key visible) or an additive ``mask [W, 1, Lq, Lk]``. ``run`` /
    ``run_backward``: every piece of a :class:`PiecePlan` over flat tensors (q ``[R, hq, d]``, k / v
    ``[K, hkv, d]``, any dtype) in a number of calls that does not grow with the pieces; None: the block
    functions over tiles (:func:`tiles_forward`)."""
    name: str
    forward: Callable
    backward: Callable
    run: Callable | None = None
    run_backward: Callable | None = None

    def attend(self, q, k, v, plan: PiecePlan, scale):
        """``(rows, out, lse)`` of ``plan``'s pieces (fp32; merge with :func:`merge_rows`)."""
        if self.run is not None:
            return self.run(q, k, v, plan, scale)
        return tiles_forward(self.forward, q, k, v, plan, scale)

    def attend_backward(self, q, k, v, out, lse, grad, plan: PiecePlan, scale, dq, dk, dv) -> None:
        if self.run_backward is not None:
            return self.run_backward(q, k, v, out, lse, grad, plan, scale, dq, dk, dv)
        return tiles_backward(self.backward, q, k, v, out, lse, grad, plan, scale, dq, dk, dv)


MATH_BLOCK = BlockKernel("math", block_forward, block_backward)
CPU_FLASH_BLOCK = BlockKernel("cpu-flash", cpu_block_forward, cpu_block_backward)
CUDA_BLOCK = BlockKernel("cuda-flash", block_forward, block_backward, run=cuda_run, run_backward=cuda_run_backward)


def block_kernel(backend: "AttnBackend | None", device) -> BlockKernel:
    """The block kernel context parallelism (and windowed packed attention) runs for a model of ``backend`` on
    ``device``: the backend's own when it has one, else the CPU's fused kernel on CPU, aten's flash attention on
    CUDA (fp16 / bf16; fp32 through the explicit fp32 tiles) and the explicit fp32 one elsewhere. ``device``: a
    torch.device, a string, or a CUDA index (``0`` is ``cuda:0``)."""
    if backend is not None and backend.block is not None:
        return backend.block
    kind = as_device(device).type
    return {"cpu": CPU_FLASH_BLOCK, "cuda": CUDA_BLOCK}.get(kind, MATH_BLOCK)


# -- attention sinks (gpt-oss) ----------------------------------------------------------------------------------
#
# A sink is one learned logit per head that joins every query's softmax denominator and carries no value:
# p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink)). Given the output and log-sum-exp merged over every key of a query
# (all pieces, every CP rank's keys), the sink enters once: lse' = logaddexp(lse, sink), out' = out exp(lse - lse').
# The backward of such attention is exactly the plain kernels' backward run with (out', lse'): their
# dS = P (dP - rowsum(dO * O)) is the softmax Jacobian with the sink's column included (its value is 0, so it adds
# nothing to dP). The sink's own gradient is -sum over queries of exp(sink - lse') rowsum(dO * O').

def add_sink(acc: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """``acc`` ``[R, hq, d]`` and ``lse`` ``[R, hq]`` (fp32, merged over all keys) with each head's ``sink``
    ``[hq]`` in the denominator, once: ``(out, lse)``. Rows with no key (``lse = -inf``) stay zero."""
    lse_s = torch.logaddexp(lse, sink.detach().float()[None])
    return acc * torch.exp(lse - lse_s).unsqueeze(-1), lse_s


def sink_grad(out: torch.Tensor, lse_s: torch.Tensor, grad: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink ``[hq]`` (fp32) from the sink-corrected output and log-sum-exp and the output's gradient."""
    d = (grad.float() * out.float()).sum(-1)                              # [R, hq]
    return -(torch.exp(sink.detach().float()[None] - lse_s) * d).sum(0)


class _PiecesAttention(torch.autograd.Function):
    """q ``[R, hq, d]``, k / v ``[K, hkv, d]`` -> ``[R, hq, d]``: every piece of a :class:`PiecePlan` by the
    kernel, merged by log-sum-exp in fp32 (rows no piece covers: zeros), each head's ``sink`` (or None) added
    once (:func:`add_sink`); the backward from the saved fp32 output and log-sum-exp. Saves q, k, v, the output
    and lse: no ``[queries, keys]`` tensor."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan, kernel):
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        merge_rows(acc, lse, *kernel.attend(q, k, v, plan, scale))
        if sink is not None:
            acc, lse = add_sink(acc, lse, sink)
        ctx.plan, ctx.kernel, ctx.scale = plan, kernel, scale
        ctx.save_for_backward(q, k, v, acc, lse, sink)
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        ctx.kernel.attend_backward(q, k, v, out, lse, grad, ctx.plan, ctx.scale, dq, dk, dv)
        dsink = sink_grad(out, lse, grad, sink).to(sink.dtype) if sink is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None


def attend_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PiecePlan,
                kernel: BlockKernel | None = None, *, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable attention of flat q ``[R, hq, d]`` over k / v ``[K, hkv, d]`` along ``plan``'s pieces
    (``kernel``: default :func:`block_kernel` for q's device); ``sink``: each head's attention-sink logit
    ``[hq]`` (gpt-oss), differentiable."""
    return _PiecesAttention.apply(q, k, v, sink, plan, kernel or block_kernel(None, q.device))
