"""Context parallelism: every sequence of a batch split over the ranks of a context-parallel (CP) group.

Every rank of a CP group holds the same full batch (``[B, S]`` ids, positions, mask); :func:`split_batch` cuts
out this rank's tokens, the same way on every rank (a pure function of the batch, ``cp`` and the rank):

* **Compaction.** Each row's real tokens (mask 1) are taken in order; padding never travels. Row ``b`` has
  ``L_b`` of them, compact indices ``0 .. L_b - 1``.
* **Load-balanced chunks (zigzag).** A sequence of (padded) length ``P`` is cut into ``2 cp`` chunks of
  ``c = P / (2 cp)`` tokens; rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``, so under causal attention every
  rank attends to the same number of keys. Padded layout: every row padded to the same ``P``, the longest
  ``L_b`` rounded up to a multiple of ``2 cp``; the local batch is ``[B, P / cp]``. Packed layout: each row
  (document) padded on its own to a multiple of ``2 cp``; the local stream is every document's two chunks in
  turn, then a tail of padding up to a multiple of ``tp`` under sequence parallelism, so every CP rank's stream
  has the same length. Padding sits at the end of each (compacted) row.
* **Per token**, kept from the full batch: the id, the given position id (so RoPE rotates by the true position,
  whatever the chunk), whether it is real, and its next-token target ``input_ids[b, t + 1]`` (``t`` its index in
  the full row) with whether that exists (``t < S - 1``, as at cp = 1): a token at a chunk boundary predicts its
  true neighbour, which another rank holds.
* **origin**: for every rank's local slots (rank-major, each rank's activations' rows ``[rows, width]``
  flattened), the flat index ``b * S + t`` in the full batch, or -1 for padding: how gathered outputs go back to
  ``[B, S]``.
* **order**: rows of the rank-major all-gathered keys / values (``[cp * rows, width, ...]``) in global order
  (per row / document, compact index ascending): what every rank's queries attend to.
* **pieces**: the attention work of this rank: each of its chunks ``j`` (contiguous local rows) attends to the
  ``j c`` keys of its row / document before it, entirely, and to its own chunk's, causally (query ``i`` sees keys
  up to ``i``); no other mask is needed: padding sits after every real token of its row, so a real query never
  sees it (a padding query sees real keys and padding, which is harmless: its output is never used). Every
  piece is a block of the model's block kernel (:func:`parallm.model.attention.block_kernel`), and the blocks
  of a chunk are merged by log-sum-exp in fp32: no ``[queries, keys]`` mask or score tensor is kept.

Activations keep the layouts of cp = 1: padded ``[rows, B, H]`` with ``rows = P / cp``; packed ``[rows, 1, H]``
(``[rows / tp, 1, H]`` between the linears under sequence parallelism). Attention reaches the other ranks' keys
and values by an all-gather over the CP group (:func:`cp_attention`; backward: the gradients reduce-scattered to
their owners) or by a ring of point-to-point transfers (:func:`ring_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..parallel.comm import gather_rows_keep_own, gather_rows_sum_back
from .attention import BlockKernel, block_kernel


@dataclass(frozen=True)
class Piece:
    """Local query rows ``[q0, q1)`` attend to key rows ``[k0, k1)``: all of them, or (``causal``) the square
    causal diagonal, query ``i`` seeing keys up to ``i``."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _chunk_pieces(q0: int, k0: int, c: int, j: int) -> list[Piece]:
    """Chunk ``j`` (``c`` queries from local row ``q0``) against its row's keys (global rows from ``k0``): the
    ``j c`` keys of the chunks before it, entirely, and its own chunk's, causally."""
    full = [Piece(q0, q0 + c, k0, k0 + j * c, False)] if j else []
    return full + [Piece(q0, q0 + c, k0 + j * c, k0 + (j + 1) * c, True)]


@dataclass
class ContextSplit:
    """This rank's share of a ``[batch, seq]`` batch under context parallelism (see the module docstring).

    Local token tensors are ``[width, rows]`` (batch-first like ``input_ids``): padded ``width = B`` rows of
    ``rows = P / cp`` tokens; packed ``width = 1``, ``rows`` the local stream. The activations are their
    transpose, ``[rows, width, ...]``; a *slot* is one of the ``rows * width`` activation rows in that order."""
    cp: int
    rank: int
    packed: bool
    batch: int
    seq: int
    rows: int
    width: int
    ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    targets: torch.Tensor
    has_next: torch.Tensor
    origin: torch.Tensor          # [cp * rows * width] long, -1: padding
    order: torch.Tensor           # [G] long: gathered key rows in global order
    pieces: tuple[Piece, ...]
    tail: int                     # local rows after the last piece (the packed stream's padding to tp)
    real_tokens: int              # real tokens of the whole batch
    segments: tuple[tuple[int, int], ...] = ()   # (first local row, chunk size c) of each row / document
    _place: tuple | None = field(default=None, repr=False)
    _ring: dict = field(default_factory=dict, repr=False)

    @property
    def slots(self) -> int:
        return self.rows * self.width

    def slot_values(self, t: torch.Tensor) -> torch.Tensor:
        """A local ``[width, rows]`` tensor in slot order (``[rows * width]``)."""
        return t.transpose(0, 1).reshape(-1)

    def placement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into the gathered slots that hold real tokens, their flat positions in ``[B * S]``)."""
        if self._place is None:
            src = (self.origin >= 0).nonzero(as_tuple=False).squeeze(-1)
            self._place = (src, self.origin.index_select(0, src))
        return self._place

    def place(self, local: torch.Tensor, group) -> torch.Tensor:
        """This rank's per-slot results ``[slots, ...]`` -> the whole batch's ``[B, S, ...]``, batch-first, zeros at
        padded positions, the same on every rank of the CP group. Differentiable: the backward keeps this rank's
        own slots (every rank computes the same loss on the same gathered tensor)."""
        gathered = gather_rows_keep_own(local, group)                 # [cp * slots, ...]
        src, dst = self.placement()
        rest = tuple(gathered.shape[1:])
        out = gathered.new_zeros((self.batch * self.seq,) + rest)
        out = out.index_put((dst,), gathered.index_select(0, src))
        return out.view((self.batch, self.seq) + rest)


def _chunk_pairs(cp: int, device) -> torch.Tensor:
    """``[cp, 2]``: the chunks rank q keeps, ``(q, 2 cp - 1 - q)``."""
    q = torch.arange(cp, device=device)
    return torch.stack([q, 2 * cp - 1 - q], dim=1)


def _owner(j: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, half) holding global chunk ``j``: chunk ``j < cp`` is rank j's first, else rank ``2 cp - 1 - j``'s
    second."""
    second = j >= cp
    return torch.where(second, 2 * cp - 1 - j, j), second.long()


def split_batch(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *, cp: int,
                rank: int, packed: bool, multiple: int = 1) -> ContextSplit:
    """This rank's :class:`ContextSplit` of a ``[B, S]`` batch (see the module docstring). ``multiple``: the
    packed local stream's length is a multiple of it (tp under sequence parallelism). One host sync (the row
    lengths)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in [0, cp={cp})")
    device = input_ids.device
    b, s = input_ids.shape
    mask = attention_mask.bool()
    lengths_t = mask.sum(1)
    lengths = lengths_t.tolist()
    # compact order of each row: its real positions first, in order (a stable sort of "is padding")
    perm = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    pairs = _chunk_pairs(cp, device)
    if packed:
        return _split_packed(input_ids, position_ids, perm, lengths, cp=cp, rank=rank, multiple=multiple,
                             pairs=pairs)
    c = -(-max(max(lengths, default=0), 1) // (2 * cp))
    rows = 2 * c
    # compact indices of every rank's local slots: [cp, rows]
    comp = (pairs[:, :, None] * c + torch.arange(c, device=device)).reshape(cp, rows)
    src = perm.gather(1, comp.reshape(1, -1).clamp(max=max(s - 1, 0)).expand(b, -1)).view(b, cp, rows)
    real = comp[None] < lengths_t[:, None, None]                                   # [B, cp, rows]
    src = torch.where(real, src, -1)
    origin = torch.where(real, src + (torch.arange(b, device=device) * s)[:, None, None], -1)
    origin = origin.permute(1, 2, 0).reshape(-1)                                   # [cp, rows, B] flattened
    mine = src[:, rank]
    # global key order: compact index g of a row -> its row in the gathered [cp * rows, B, ...]
    g = torch.arange(cp * rows, device=device)
    j = g // c
    owner, half = _owner(j, cp)
    order = owner * rows + half * c + (g - j * c)
    pieces = tuple(p for h, jj in enumerate((rank, 2 * cp - 1 - rank)) for p in _chunk_pieces(h * c, 0, c, jj))
    return _finish(input_ids, position_ids, mine, cp=cp, rank=rank, packed=False, rows=rows, width=b,
                   origin=origin, order=order, pieces=pieces, tail=0, real_tokens=sum(lengths),
                   segments=((0, c),))


def _split_packed(input_ids, position_ids, perm, lengths, *, cp, rank, multiple, pairs) -> ContextSplit:
    device = input_ids.device
    b, s = input_ids.shape
    docs = [(row, n) for row, n in enumerate(lengths) if n > 0]
    local_len = [2 * -(-n // (2 * cp)) for _, n in docs]               # 2 c_d per rank
    used = sum(local_len)
    rows = -(-max(used, 1) // multiple) * multiple
    comps, rows_of, reals, order, pieces, segments = [], [], [], [], [], []
    at_local, at_global = 0, 0
    for (row, n), two_c in zip(docs, local_len):
        c = two_c // 2
        comp = (pairs[:, :, None] * c + torch.arange(c, device=device)).reshape(cp, two_c)   # [cp, 2c]
        comps.append(comp)
        segments.append((at_local, c))
        rows_of.append(torch.full((two_c,), row, dtype=torch.long, device=device))
        reals.append(comp < n)
        g = torch.arange(2 * cp * c, device=device)
        j = g // c
        owner, half = _owner(j, cp)
        order.append(owner * rows + at_local + half * c + (g - j * c))
        for h, jj in enumerate((rank, 2 * cp - 1 - rank)):
            pieces += _chunk_pieces(at_local + h * c, at_global, c, jj)
        at_local += two_c
        at_global += 2 * cp * c
    tail = rows - used
    empty = torch.zeros(cp, 0, dtype=torch.long, device=device)
    comp = torch.cat(comps, dim=1) if comps else empty                            # [cp, used]
    row_of = torch.cat(rows_of) if rows_of else empty[0]
    real = torch.cat(reals, dim=1) if reals else empty.bool()
    src = perm[row_of[None].expand(cp, -1), comp.clamp(max=max(s - 1, 0))] if comps else empty
    src = torch.where(real, src, -1)
    pad = torch.full((cp, tail), -1, dtype=torch.long, device=device)
    src_all = torch.cat([src, pad], dim=1)                                        # [cp, rows]
    row_all = torch.cat([row_of, torch.zeros(tail, dtype=torch.long, device=device)])
    origin = torch.where(src_all >= 0, src_all + row_all[None] * s, -1).reshape(-1)
    mine = src_all[rank]
    order = torch.cat(order) if order else empty[0]
    return _finish(input_ids, position_ids, mine[None], cp=cp, rank=rank, packed=True, rows=rows, width=1,
                   origin=origin, order=order, pieces=tuple(pieces), tail=tail, real_tokens=sum(lengths),
                   rows_of=row_all[None], segments=tuple(segments))


def _finish(input_ids, position_ids, src, *, cp, rank, packed, rows, width, origin, order, pieces, tail,
            real_tokens, rows_of=None, segments=()) -> ContextSplit:
    """Local ids / positions / realness / targets from ``src`` (``[width, rows]``: each local slot's index in its
    full row, -1 for padding; ``rows_of``: each slot's row, packed only)."""
    device = input_ids.device
    s = input_ids.shape[1]
    real = src >= 0
    at = src.clamp(min=0)
    if rows_of is None:
        rows_of = torch.arange(input_ids.shape[0], device=device)[:, None].expand_as(src)
    ids = torch.where(real, input_ids[rows_of, at], 0)
    pos = torch.where(real, position_ids[rows_of, at], 0)
    has_next = real & (src + 1 < s)
    targets = torch.where(has_next, input_ids[rows_of, (src + 1).clamp(min=0, max=max(s - 1, 0))], 0)
    return ContextSplit(cp=cp, rank=rank, packed=packed, batch=input_ids.shape[0], seq=s, rows=rows,
                        width=width, ids=ids, positions=pos, real=real, targets=targets, has_next=has_next,
                        origin=origin, order=order, pieces=pieces, tail=tail, real_tokens=real_tokens,
                        segments=segments)


def _attend(qf, kf, vf, pieces, kernel: BlockKernel, acc, lse, scale) -> None:
    """Every piece's block attention (fp32 ``qf [W, hq, rows, d]``, ``kf`` / ``vf [W, hkv, keys, d]``) merged into
    the accumulators ``acc`` / ``lse`` in place."""
    for p in pieces:
        o, s = kernel.forward(qf[:, :, p.q0:p.q1], kf[:, :, p.k0:p.k1], vf[:, :, p.k0:p.k1], p.causal, scale)
        _merge(acc, lse, o, s, p.q0, p.q1)


def _attend_backward(qf, kf, vf, out, lse, g, pieces, kernel: BlockKernel, dq, dk, dv, scale) -> None:
    """The gradients of :func:`_attend`'s pieces from the final ``out`` / ``lse``, added into ``dq`` and the fp32
    ``dk`` / ``dv`` (shaped like ``kf`` / ``vf``) in place."""
    for p in pieces:
        rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
        dqp, dkp, dvp = kernel.backward(qf[:, :, rows], kf[:, :, keys], vf[:, :, keys], out[:, :, rows],
                                        lse[:, :, rows], g[:, :, rows], p.causal, scale)
        dq[:, :, rows] += dqp
        dk[:, :, keys] += dkp
        dv[:, :, keys] += dvp


def _merge(acc_out, acc_lse, out, lse, q0, q1):
    """Fold one block's ``(out, lse)`` for query rows ``[q0, q1)`` into the fp32 accumulators (in place)."""
    old_o, old_l = acc_out[:, :, q0:q1], acc_lse[:, :, q0:q1]
    new_l = torch.logaddexp(old_l, lse)
    old_o.mul_(torch.exp(old_l - new_l).unsqueeze(-1)).add_(out * torch.exp(lse - new_l).unsqueeze(-1))
    old_l.copy_(new_l)


def _accumulators(qf):
    return torch.zeros_like(qf), torch.full(qf.shape[:3], float("-inf"), dtype=torch.float32, device=qf.device)


class _PieceAttention(torch.autograd.Function):
    """q ``[rows, width, hq, d]`` against the whole sequence's keys and values in global order ``kv [G, width,
    2 hkv, d]`` -> ``[rows, width, hq, d]``: each :class:`Piece` a block of the kernel, merged by log-sum-exp in
    fp32; the backward from the saved output and log-sum-exp. Saves q, kv, the fp32 output and lse: no
    ``[queries, keys]`` tensor, no mask."""

    @staticmethod
    def forward(ctx, q, kv, split, kernel):
        scale = 1.0 / math.sqrt(q.shape[-1])
        hkv = kv.shape[2] // 2
        qf = q.permute(1, 2, 0, 3).float()                                       # [W, hq, rows, d]
        kvf = kv.permute(1, 2, 0, 3).float()                                     # [W, 2 hkv, G, d]
        acc, lse = _accumulators(qf)
        _attend(qf, kvf[:, :hkv], kvf[:, hkv:], split.pieces, kernel, acc, lse, scale)
        ctx.split, ctx.kernel, ctx.scale = split, kernel, scale
        ctx.save_for_backward(q, kv, acc, lse)
        return acc.to(q.dtype).permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, grad):
        q, kv, out, lse = ctx.saved_tensors
        hkv = kv.shape[2] // 2
        qf = q.permute(1, 2, 0, 3).float()
        kvf = kv.permute(1, 2, 0, 3).float()
        g = grad.permute(1, 2, 0, 3).float()
        dq = torch.zeros_like(qf)
        dkv = torch.zeros(kvf.shape, dtype=torch.float32, device=kv.device)
        _attend_backward(qf, kvf[:, :hkv], kvf[:, hkv:], out, lse, g, ctx.split.pieces, ctx.kernel, dq,
                         dkv[:, :hkv], dkv[:, hkv:], ctx.scale)
        return dq.to(q.dtype).permute(2, 0, 1, 3), dkv.to(kv.dtype).permute(2, 0, 1, 3), None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: ContextSplit, group,
                 kernel: BlockKernel | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys: q ``[rows, width, hq, d]``, k / v
    ``[rows, width, hkv, d]`` (this rank's tokens, RoPE applied) -> ``[rows, width, hq, d]``.

    Keys and values are all-gathered over the CP group in one collective (backward: their gradients
    reduce-scattered onto the owners), then :func:`attend_pieces`. Memory kept for the backward: the whole
    sequence's K and V per layer, ``2 * hkv * d`` values per token. ``kernel``: the block kernel
    (:func:`parallm.model.attention.block_kernel`; default: the one for this device)."""
    kv = gather_rows_sum_back(torch.cat([k, v], dim=2), group)                 # [cp * rows, width, 2 hkv, d]
    return attend_pieces(q, kv, split, kernel)


def attend_pieces(q: torch.Tensor, kv: torch.Tensor, split: ContextSplit, kernel: BlockKernel | None = None
                  ) -> torch.Tensor:
    """q ``[rows, width, hq, d]``; kv: every rank's keys and values, rank-major, ``[cp * rows, width, 2 hkv,
    d]`` (keys first along dim 2). The keys are put in global order (:attr:`ContextSplit.order`) and each chunk
    of this rank attends to the keys of its row / document before it (entirely) and to its own chunk's
    (causally), merged by log-sum-exp (:class:`_PieceAttention`); the packed stream's tail rows get zeros."""
    kv = kv.index_select(0, split.order)                                      # [G, width, 2 hkv, d]
    return _PieceAttention.apply(q, kv, split, kernel or block_kernel(None, q.device))


# -- the ring ---------------------------------------------------------------------------------------------------
#
# Keys and values travel around the CP group (rank i sends to i + 1) instead of being gathered: at step t rank r
# holds the block of rank (r - t) mod cp, attends its queries to it (each of its chunks against each of the
# block's chunks that is not in its future: chunk j before chunk i entirely, j == i causally) and merges the
# partial result into fp32 accumulators with the log-sum-exp correction; the next block's transfer runs during
# the compute. The backward walks the ring again from the saved output and log-sum-exp: each block's dK / dV
# accumulate (fp32) in a buffer that travels with it and arrives at its owner after the last step.


def ring_pieces(split: ContextSplit, source: int) -> tuple[Piece, ...]:
    """This rank's work against the key block of rank ``source``: pieces with local query rows and local rows of
    the block (the same layout on every rank); chunks with nothing to see are left out."""
    cached = split._ring.get(source)
    if cached is not None:
        return cached
    cp, r = split.cp, split.rank
    out = []
    for start, c in split.segments:
        for h, i in enumerate((r, 2 * cp - 1 - r)):
            for h2, j in enumerate((source, 2 * cp - 1 - source)):
                if j <= i:
                    out.append(Piece(start + h * c, start + (h + 1) * c, start + h2 * c, start + (h2 + 1) * c,
                                     j == i))
    split._ring[source] = out = tuple(out)
    return out


class _RingAttention(torch.autograd.Function):
    """q ``[rows, width, hq, d]``, k / v ``[rows, width, hkv, d]`` -> ``[rows, width, hq, d]``; see the notes
    above :func:`ring_pieces`."""

    @staticmethod
    def forward(ctx, q, k, v, split, group, kernel):
        from ..parallel.comm import RingExchange
        cp, r = split.cp, split.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        hkv = k.shape[2]
        qf = q.permute(1, 2, 0, 3).float()                                       # [W, hq, rows, d]
        acc, lse = _accumulators(qf)
        kv = torch.cat([k, v], dim=2)
        ring = RingExchange(group)
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)
            block = kv.permute(1, 2, 0, 3).float()                                # [W, 2 hkv, rows, d]
            _attend(qf, block[:, :hkv], block[:, hkv:], ring_pieces(split, (r - step) % cp), kernel, acc, lse,
                    scale)
            if step < cp - 1:
                kv = ring.wait()
        ctx.split, ctx.group, ctx.scale, ctx.kernel = split, group, scale, kernel
        ctx.save_for_backward(q, k, v, acc, lse)
        return acc.to(q.dtype).permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, grad):
        from ..parallel.comm import RingExchange
        q, k, v, out, lse = ctx.saved_tensors
        split, scale = ctx.split, ctx.scale
        cp, r = split.cp, split.rank
        hkv = k.shape[2]
        qf = q.permute(1, 2, 0, 3).float()
        g = grad.permute(1, 2, 0, 3).float()
        dq = torch.zeros_like(qf)
        kv = torch.cat([k, v], dim=2)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)     # travels with its block
        ring, back = RingExchange(ctx.group), RingExchange(ctx.group)
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)
            block = kv.permute(1, 2, 0, 3).float()
            dblock = dkv.permute(1, 2, 0, 3)                                      # a view: adds land in dkv
            _attend_backward(qf, block[:, :hkv], block[:, hkv:], out, lse, g, ring_pieces(split, (r - step) % cp),
                             ctx.kernel, dq, dblock[:, :hkv], dblock[:, hkv:], scale)
            back.start(dkv)          # to the next rank; after the last step it reaches the block's owner
            if step < cp - 1:
                kv = ring.wait()
            dkv = back.wait()
        dq = dq.to(q.dtype).permute(2, 0, 1, 3)
        dk, dv = dkv.to(k.dtype).split(hkv, dim=2)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: ContextSplit, group,
                   kernel: BlockKernel | None = None) -> torch.Tensor:
    """:func:`cp_attention`'s result by a ring of point-to-point transfers instead of an all-gather: no rank holds
    more than two blocks of keys and values (``2 / cp`` of the sequence's) at a time, and nothing of them is kept
    for the backward; the price is ``cp`` steps (recomputed in the backward) whose transfers overlap the compute.
    ``kernel``: the block kernel (the model's attention backend's, :func:`parallm.model.attention.block_kernel`;
    default: the one for this device)."""
    return _RingAttention.apply(q, k, v, split, group, kernel or block_kernel(None, q.device))


CP_KERNELS = {"allgather": cp_attention, "ring": ring_attention}
CP_AUTO = "ring"           # what cp_attn="auto" picks (docs/context-parallel.md says why: measured)


def resolve_cp_attn(cp_attn: str) -> str:
    """The context-parallel attention a model built with ``cp_attn`` ("auto" or a name in :data:`CP_KERNELS`)
    runs; anything else is a ValueError naming the choices."""
    if cp_attn == "auto":
        return CP_AUTO
    if cp_attn not in CP_KERNELS:
        raise ValueError(f"cp_attn must be 'auto' or one of {sorted(CP_KERNELS)}, got {cp_attn!r}")
    return cp_attn
