"""Where DeepSeek-V4's attention (:mod:`parallm.model.layers.v4_attention`) finds each query's keys: the batch's
documents in the *key stream* (the flat rows of the raw keys, every token's), each query's document and index
in it, and per compression rate the compressed entries each document has. Made once per batch from the layer
context and kept on it (every V4 layer of the batch reads it); no ``[S, S]`` tensor anywhere.

Key stream and documents:

* **padded** ``[S, B]`` (:class:`PaddedRows`): the activations flattened ``[S * B]`` (row ``s * B + b``); row ``b``
  of the batch is a document of its real tokens (``base b``, ``stride B``). Padding must come after every real
  token of its row (right padding): transformers pools left-padded rows from the padding on, which is refused.
* **packed** ``[T, 1]`` (:class:`Packing`): each document of the stream (``base`` its first token, stride 1); the
  stream's tail of padding is no document, its queries see nothing.
* **context parallelism** (:class:`ContextSplit`): the keys of the whole batch, all-gathered over the CP group
  and put in global order (``[cp * rows, width]`` flattened: padded, row ``b`` is document ``b`` with stride
  ``width``; packed, each document's ``2 cp c`` rows); this rank's queries are its local slots, their index in
  their document their position id (real tokens only).

A query at index ``i`` of its document sees the raw keys ``i - window < j <= i`` of its document and the
compressed entries ``e < (i + 1) // rate`` of it (transformers' ``(position_ids + 1) // compress_rate``): entry
``e`` pools the document's tokens ``[e rate, (e + 1) rate)`` (CSA: also the previous window), so it is complete
when the query sees it. Entries of every document are numbered one after the other (``first[d]`` is document
``d``'s first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..context_parallel import ContextSplit
from .attention import Packing, PaddedRows
from .indexer_plan import KeyRanges


@dataclass
class Entries:
    """The compressed entries of one rate: ``count`` ``[D]`` per document, ``first`` ``[D]`` the number of the
    document's first entry, ``rows`` ``[E, rate]`` the key-stream rows each entry pools, ``prev_ok`` ``[E]``
    whether the entry has a previous window in its document (CSA's overlap), ``visible`` ``[Q]`` how many of its
    document's entries each query sees, ``total`` / ``most`` (python ints): entries in all, the most a query
    sees."""
    count: torch.Tensor
    first: torch.Tensor
    rows: torch.Tensor
    prev_ok: torch.Tensor
    visible: torch.Tensor
    total: int
    most: int
    ranges: KeyRanges | None = None      # for the indexer's top-k (made on first use)


@dataclass
class V4Layout:
    """One batch's documents (see the module docstring). Device tensors: ``base`` / ``stride`` / ``length``
    ``[D]`` (length: real tokens), ``q_doc`` / ``q_idx`` / ``q_real`` ``[Q]`` for the queries (this rank's rows in
    activation order: ``[S * B]`` padded, ``[T]`` packed, the local slots under CP). ``keys``: rows of the key
    stream; ``key_pos``: its rows' positions (their index in their document) where the key stream is not the
    queries' (context parallelism), else None."""
    keys: int
    base: torch.Tensor
    stride: torch.Tensor
    length: torch.Tensor
    lengths: list
    q_doc: torch.Tensor
    q_idx: torch.Tensor
    q_real: torch.Tensor
    key_pos: torch.Tensor | None = None      # the key stream's positions where it is not the queries' (CP)
    order: torch.Tensor | None = None        # the queries document by document where they are not (padded, B > 1)
    _entries: dict = field(default_factory=dict, repr=False)

    def window(self, window: int, a: int = 0, e: int | None = None, *, sel=None) -> torch.Tensor:
        """``[e - a, window]`` int32: queries ``a .. e - 1``'s raw keys (key-stream rows), its own first, -1 where
        the window reaches before its document's start (or for a query that is no real token). ``sel``: the
        queries instead (a slice or a long tensor of query rows)."""
        sel = slice(a, e) if sel is None else sel
        doc, idx = self.q_doc[sel], self.q_idx[sel]
        back = idx[:, None] - torch.arange(window, device=idx.device)
        ok = (back >= 0) & self.q_real[sel][:, None]
        rows = self.base[doc][:, None] + back * self.stride[doc][:, None]
        return torch.where(ok, rows, -1).to(torch.int32)

    def entries(self, rate: int) -> Entries:
        """The :class:`Entries` of ``rate`` (made once per batch)."""
        if rate not in self._entries:
            self._entries[rate] = self._make_entries(rate)
        return self._entries[rate]

    def _make_entries(self, rate: int) -> Entries:
        dev = self.base.device
        count_l = [n // rate for n in self.lengths]
        total = sum(count_l)
        count = torch.tensor(count_l, dtype=torch.long, device=dev)
        first = torch.cumsum(count, 0) - count
        doc = torch.repeat_interleave(torch.arange(len(count_l), device=dev), count, output_size=total)
        j = torch.arange(total, device=dev) - first[doc]
        tok = j[:, None] * rate + torch.arange(rate, device=dev)                         # index in the document
        rows = self.base[doc][:, None] + tok * self.stride[doc][:, None]
        visible = torch.minimum(torch.div(self.q_idx + 1, rate, rounding_mode="floor"), count[self.q_doc])
        visible = torch.where(self.q_real, visible, 0)
        return Entries(count=count, first=first, rows=rows, prev_ok=j >= 1, visible=visible, total=total,
                       most=max(count_l, default=0))

    def compressed(self, rate: int, offset: int, a: int = 0, e: int | None = None, *, sel=None) -> torch.Tensor:
        """``[e - a, most]`` int32: every compressed entry queries ``a .. e - 1`` (or ``sel``) see (HCA), as rows
        ``offset + entry`` of the keys, -1 in the rest."""
        sel = slice(a, e) if sel is None else sel
        ent = self.entries(rate)
        m = torch.arange(ent.most, device=self.q_idx.device)
        first = offset + ent.first[self.q_doc[sel]][:, None]
        return torch.where(m < ent.visible[sel][:, None], first + m, -1).to(torch.int32)

    def entry_ranges(self, rate: int) -> KeyRanges:
        """The indexer's :class:`KeyRanges` over the entries of ``rate`` (one stream, width 1): query ``t`` sees
        entries ``first[doc] .. first[doc] + visible - 1`` (made once per batch; one host copy)."""
        e = self.entries(rate)
        if e.ranges is None:
            lo = e.first[self.q_doc]
            hi = lo + e.visible - 1
            e.ranges = KeyRanges(width=1, lo=lo.cpu(), hi=hi.cpu(), key_rows=e.total, real=None, longest=e.most)
        return e.ranges


class V4Index:
    """Each query's rows of the key matrix (the raw kv rows of the key stream, then the entries from row
    ``layout.keys``), int32, -1 in empty slots, made block by block (``index[a:e]``, or ``index.take(rows)`` for
    a long tensor of query rows; ``.shape``) for the sparse kernel, never whole: its sliding window, then on HCA
    layers (``rate``) every entry it sees, on CSA layers the indexer's ``selected`` entries ``[Q, topk]`` (entry
    numbers, -1: none). ``order``: the layout's queries document by document (padded, B > 1; else None), the
    order in which the kernel's union path takes its blocks."""

    def __init__(self, lay: V4Layout, window: int, *, rate: int | None = None,
                 selected: torch.Tensor | None = None):
        self.lay, self.window, self.rate, self.selected = lay, window, rate, selected
        extra = selected.shape[1] if selected is not None else lay.entries(rate).most if rate else 0
        self.shape = (int(lay.q_idx.numel()), window + extra)
        self.order = lay.order

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, e, _ = rows.indices(self.shape[0])
        return self.take(slice(a, e))

    def take(self, rows) -> torch.Tensor:
        """The index rows of the queries ``rows`` (a slice or a long tensor)."""
        parts = [self.lay.window(self.window, sel=rows)]
        if self.selected is not None:
            sel = self.selected[rows]
            parts.append(torch.where(sel >= 0, sel + self.lay.keys, sel))
        elif self.rate:
            parts.append(self.lay.compressed(self.rate, self.lay.keys, sel=rows))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def full(self) -> torch.Tensor:
        """The whole index ``[Q, width]`` (tests)."""
        return self[0:self.shape[0]]


def _padded(ctx: PaddedRows) -> V4Layout:
    keep = ctx.keep.bool()
    b, s = keep.shape
    if s > 1 and bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        rows = (keep[:, 1:] & ~keep[:, :-1]).any(1).nonzero().flatten().tolist()
        raise ValueError(f"DeepSeek-V4 attention needs right padding (real tokens first in every row); rows {rows} "
                         "have padding before a real token (transformers pools such a row from its padding on)")
    dev = keep.device
    length = keep.sum(1)
    idx = torch.arange(s, device=dev)[:, None].expand(s, b).reshape(-1)
    doc = torch.arange(b, device=dev)[None, :].expand(s, b).reshape(-1)
    order = torch.arange(s * b, device=dev).view(s, b).transpose(0, 1).reshape(-1) if b > 1 else None
    return V4Layout(keys=s * b, base=torch.arange(b, device=dev), stride=torch.full((b,), b, device=dev),
                    length=length, lengths=length.tolist(), q_doc=doc, q_idx=idx,
                    q_real=keep.transpose(0, 1).reshape(-1), order=order)


def _packed(ctx: Packing) -> V4Layout:
    cu = ctx.cu_seqlens.to(torch.long)
    dev = cu.device
    seg = cu[1:] - cu[:-1]
    length = torch.where(cu[1:] <= ctx.nnz, seg, 0)               # the tail of padding to tp: no document
    t = torch.arange(ctx.total, device=dev)
    doc = torch.repeat_interleave(torch.arange(seg.numel(), device=dev), seg, output_size=ctx.total)
    return V4Layout(keys=ctx.total, base=cu[:-1], stride=torch.ones_like(seg), length=length,
                    lengths=length.tolist(), q_doc=doc, q_idx=t - cu[:-1][doc], q_real=t < ctx.nnz)


def _context_split(ctx: ContextSplit) -> V4Layout:
    dev = ctx.ids.device
    real = ctx.slot_values(ctx.real).bool()
    pos = ctx.slot_values(ctx.positions).long()
    if ctx.packed:
        sizes = [2 * ctx.cp * c for _, c in ctx.segments]
        starts = torch.tensor([0] + sizes[:-1], dtype=torch.long, device=dev).cumsum(0)
        # each local slot's document: the segment whose local rows hold it (the tail: none)
        local_start = torch.tensor([r0 for r0, _ in ctx.segments], dtype=torch.long, device=dev)
        local_end = local_start + 2 * torch.tensor([c for _, c in ctx.segments], dtype=torch.long, device=dev)
        slot = torch.arange(ctx.slots, device=dev)
        doc = torch.searchsorted(local_end, slot, right=True).clamp(max=max(len(sizes) - 1, 0))
        real = real & (slot < local_end[-1] if sizes else torch.zeros_like(real))
        lengths = _real_lengths(ctx, sizes)
        base, stride = starts, torch.ones_like(starts)
    else:
        lengths = _real_lengths(ctx, None)
        doc = torch.arange(ctx.width, device=dev).repeat(ctx.rows)
        base = torch.arange(ctx.width, device=dev)
        stride = torch.full((ctx.width,), ctx.width, dtype=torch.long, device=dev)
    length = torch.tensor(lengths, dtype=torch.long, device=dev)
    keys = ctx.order.numel() * ctx.width
    return V4Layout(keys=keys, base=base, stride=stride, length=length, lengths=lengths, q_doc=doc,
                    q_idx=torch.where(real, pos, 0), q_real=real, key_pos=_key_positions(keys, base, stride, length))


def _key_positions(keys: int, base, stride, length) -> torch.Tensor:
    """Each key-stream row's index in its document (0 for rows of no document / padding)."""
    out = torch.zeros(keys, dtype=torch.long, device=base.device)
    doc = torch.repeat_interleave(torch.arange(base.numel(), device=base.device), length,
                                  output_size=int(sum(length.tolist())))
    idx = torch.arange(doc.numel(), device=base.device) - (torch.cumsum(length, 0) - length)[doc]
    out[base[doc] + idx * stride[doc]] = idx
    return out


def _real_lengths(ctx: ContextSplit, sizes) -> list:
    """The real tokens of each document of the gathered stream (padded: of each row), from ``origin``: the
    gathered slots that hold a real token, counted per document."""
    origin = ctx.origin.view(ctx.cp, ctx.rows, ctx.width)            # rank-major local slots
    real = (origin >= 0).reshape(ctx.cp * ctx.rows, ctx.width)        # gathered rows, not yet in global order
    real = real.index_select(0, ctx.order)                             # global order
    if sizes is None:
        return real.sum(0).tolist()
    ends = torch.tensor(sizes, dtype=torch.long, device=real.device).cumsum(0)
    counts = torch.cat([real.new_zeros(1, dtype=torch.long), real[:, 0].long().cumsum(0)])
    return (counts[ends] - counts[ends - torch.tensor(sizes, dtype=torch.long, device=real.device)]).tolist()


def v4_layout(ctx) -> V4Layout:
    """The :class:`V4Layout` of a layer context (made once per batch, kept on it)."""
    cached = getattr(ctx, "_v4_layout", None)
    if cached is not None:
        return cached
    if isinstance(ctx, PaddedRows):
        out = _padded(ctx)
    elif isinstance(ctx, Packing):
        out = _packed(ctx)
    elif isinstance(ctx, ContextSplit):
        out = _context_split(ctx)
    else:
        raise TypeError(f"DeepSeek-V4 attention needs a PaddedRows, Packing or ContextSplit context, got "
                        f"{type(ctx).__name__}")
    ctx._v4_layout = out
    return out
