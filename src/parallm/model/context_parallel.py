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
  sees it (a padding query sees real keys and padding, which is harmless: its output is never used). With a
  sliding window each piece is cut to the keys the window reaches, and pieces wholly outside it are dropped
  (:meth:`ContextSplit.plan`, :func:`ring_plan`). All pieces of a rank (or of a ring step) run in one call of
  the model's block kernel (:func:`parallm.model.layers.blocks.block_kernel`, a
  :class:`parallm.model.layers.blocks.PiecePlan`), whatever the number of documents, and the parts of a query are
  merged by log-sum-exp in fp32: no ``[queries, keys]`` mask or score tensor of a sequence is built.

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
from .layers.blocks import (BlockKernel, Piece, PiecePlan, add_sink, attend_plan, block_kernel, merge_rows,
                            sink_grad)


def _chunk_pieces(q0: int, k0: int, c: int, j: int) -> list[Piece]:
    """Chunk ``j`` (``c`` queries from local row ``q0``) against its row's keys (global rows from ``k0``): the
    ``j c`` keys of the chunks before it, entirely, and its own chunk's, causally."""
    full = [Piece(q0, q0 + c, k0, k0 + j * c, j * c)] if j else []
    return full + [Piece(q0, q0 + c, k0 + j * c, k0 + (j + 1) * c, 0)]


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
    _plans: dict = field(default_factory=dict, repr=False)

    def documents_cu(self) -> torch.Tensor:
        """The gathered packed stream's documents (each ``2 cp c`` rows: its chunks in sequence order) as int64
        ``cu_seqlens`` on the batch's device, made once per batch (every linear-attention layer reads it)."""
        if "documents_cu" not in self._plans:
            lengths = torch.tensor([2 * self.cp * c for _, c in self.segments], dtype=torch.long,
                                   device=self.ids.device)
            self._plans["documents_cu"] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return self._plans["documents_cu"]

    def rows_cu(self) -> torch.Tensor:
        """The padded layout's gathered rows (``cp * rows`` tokens each, compacted) as the documents of a packed
        stream, row after row: int64 ``cu_seqlens``, made once per batch."""
        if "rows_cu" not in self._plans:
            n = self.cp * self.rows
            self._plans["rows_cu"] = torch.arange(0, (self.width + 1) * n, n, dtype=torch.long,
                                                  device=self.ids.device)
        return self._plans["rows_cu"]

    def plan(self, window: int | None = None) -> PiecePlan:
        """:attr:`pieces` as one :class:`PiecePlan` (over the flat ``[rows * width]`` slots and the gathered keys
        in global order), clipped to ``window``: pieces wholly outside it dropped. Kept for the other layers."""
        if window not in self._plans:
            self._plans[window] = PiecePlan(self.pieces, width=self.width, window=window)
        return self._plans[window]

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


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: ContextSplit, group,
                 kernel: BlockKernel | None = None, *, window: int | None = None,
                 sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys: q ``[rows, width, hq, d]``, k / v
    ``[rows, width, hkv, d]`` (this rank's tokens, RoPE applied) -> ``[rows, width, hq, d]``.

    Keys and values are all-gathered over the CP group in one collective (backward: their gradients
    reduce-scattered onto the owners), then :func:`attend_pieces`. Memory kept for the backward: the whole
    sequence's K and V per layer, ``2 * hkv * d`` values per token. ``kernel``: the block kernel
    (:func:`parallm.model.layers.blocks.block_kernel`; default: the one for this device); ``window``: the layer's
    sliding window (None: full causal attention); ``sink``: each head's attention-sink logit (added once, after
    every key of the sequence is merged)."""
    kv = gather_rows_sum_back(torch.cat([k, v], dim=2), group)                 # [cp * rows, width, 2 hkv, d]
    return attend_pieces(q, kv, split, kernel, window=window, sink=sink)


def attend_pieces(q: torch.Tensor, kv: torch.Tensor, split: ContextSplit, kernel: BlockKernel | None = None, *,
                  window: int | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[rows, width, hq, d]``; kv: every rank's keys and values, rank-major, ``[cp * rows, width, 2 hkv,
    d]`` (keys first along dim 2). The keys are put in global order (:attr:`ContextSplit.order`) and each chunk
    of this rank attends to the keys of its row / document before it (entirely) and to its own chunk's
    (causally), within ``window`` when given: :meth:`ContextSplit.plan`'s pieces in one kernel call
    (:func:`parallm.model.layers.blocks.attend_plan`), merged by log-sum-exp; the packed stream's tail rows get
    zeros."""
    rows, width, hq, d = q.shape
    hkv = kv.shape[2] // 2
    kv = kv.index_select(0, split.order)                                      # [G, width, 2 hkv, d]
    k = kv[:, :, :hkv].reshape(-1, hkv, d)
    v = kv[:, :, hkv:].reshape(-1, hkv, d)
    out = attend_plan(q.reshape(rows * width, hq, d), k, v, split.plan(window),
                      kernel or block_kernel(None, q.device), sink=sink)
    return out.view(rows, width, hq, d)


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
                                     (i - j) * c))
    split._ring[source] = out = tuple(out)
    return out


def ring_plan(split: ContextSplit, source: int, window: int | None = None) -> PiecePlan:
    """:func:`ring_pieces` against ``source``'s block as one :class:`PiecePlan` (flat ``[rows * width]`` rows of
    the queries and of the block), clipped to ``window``: a chunk wholly outside it is not computed."""
    key = (source, window)
    if key not in split._plans:
        split._plans[key] = PiecePlan(ring_pieces(split, source), width=split.width, window=window)
    return split._plans[key]


class _RingAttention(torch.autograd.Function):
    """q ``[rows, width, hq, d]``, k / v ``[rows, width, hkv, d]`` -> ``[rows, width, hq, d]``; see the notes
    above :func:`ring_pieces`."""

    @staticmethod
    def forward(ctx, q, k, v, sink, split, group, kernel, window):
        from ..parallel.comm import RingExchange
        cp, r = split.cp, split.rank
        rows, width, hq, d = q.shape
        hkv = k.shape[2]
        scale = 1.0 / math.sqrt(d)
        qf = q.reshape(rows * width, hq, d)
        acc = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=2)
        ring = RingExchange(group)
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)
            plan = ring_plan(split, (r - step) % cp, window)
            if plan.pieces:
                merge_rows(acc, lse, *kernel.attend(qf, kv[:, :, :hkv].reshape(-1, hkv, d),
                                                    kv[:, :, hkv:].reshape(-1, hkv, d), plan, scale))
            if step < cp - 1:
                kv = ring.wait()
        if sink is not None:        # once, after every block of the sequence is merged
            acc, lse = add_sink(acc, lse, sink)
        ctx.split, ctx.group, ctx.scale, ctx.kernel, ctx.window = split, group, scale, kernel, window
        ctx.save_for_backward(q, k, v, acc, lse, sink)
        return acc.to(q.dtype).view(rows, width, hq, d)

    @staticmethod
    def backward(ctx, grad):
        from ..parallel.comm import RingExchange
        q, k, v, out, lse, sink = ctx.saved_tensors
        split, scale = ctx.split, ctx.scale
        cp, r = split.cp, split.rank
        rows, width, hq, d = q.shape
        hkv = k.shape[2]
        qf = q.reshape(rows * width, hq, d)
        g = grad.reshape(rows * width, hq, d)
        dq = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=2)
        # dK and dV of the block in hand, [2, rows * width, hkv, d] fp32: travels with its block
        dkv = torch.zeros((2, rows * width, hkv, d), dtype=torch.float32, device=kv.device)
        ring, back = RingExchange(ctx.group), RingExchange(ctx.group)
        for step in range(cp):
            if step < cp - 1:
                ring.start(kv)
            plan = ring_plan(split, (r - step) % cp, ctx.window)
            if plan.pieces:
                ctx.kernel.attend_backward(qf, kv[:, :, :hkv].reshape(-1, hkv, d),
                                           kv[:, :, hkv:].reshape(-1, hkv, d), out, lse, g, plan, scale, dq,
                                           dkv[0], dkv[1])
            back.start(dkv)          # to the next rank; after the last step it reaches the block's owner
            if step < cp - 1:
                kv = ring.wait()
            dkv = back.wait()
        dq = dq.to(q.dtype).view(rows, width, hq, d)
        dk, dv = (t.to(k.dtype).view(rows, width, hkv, d) for t in dkv)
        dsink = sink_grad(out, lse, g, sink).to(sink.dtype) if sink is not None else None
        return dq, dk, dv, dsink, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: ContextSplit, group,
                   kernel: BlockKernel | None = None, *, window: int | None = None,
                   sink: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cp_attention`'s result by a ring of point-to-point transfers instead of an all-gather: no rank holds
    more than two blocks of keys and values (``2 / cp`` of the sequence's) at a time, and nothing of them is kept
    for the backward; the price is ``cp`` steps (recomputed in the backward) whose transfers overlap the compute.
    ``kernel``: the block kernel (the model's attention backend's, :func:`parallm.model.layers.blocks.block_kernel`;
    default: the one for this device); ``window``: the layer's sliding window (a step whose block lies wholly
    outside it for every chunk computes nothing, its transfer still made: every rank takes the same steps);
    ``sink``: each head's attention-sink logit, added once after the last step's merge."""
    return _RingAttention.apply(q, k, v, sink, split, group, kernel or block_kernel(None, q.device), window)


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
