"""The export stream's plan: which rank sends which rows of which HF tensor in which bucket, and where they land.

Pure functions of the model's entry list and of what every rank holds (no torch.distributed): every rank computes
the same plan from the same exchange, and the tests run it in one process. The exchange that runs it is
:mod:`parallm.checkpoint.export`.

    piece    the shard of one TP rank of one saved table entry (``copy`` entries: TP rank 0's only), sent by
             the rank holding it with the lowest data-parallel rank. Pieces are found from what every rank
             holds (a bitmap over the global entry list), never from rank arithmetic, so entries owned by
             other kinds of ranks (expert-parallel experts) plan the same way.
    part     one block of a piece (the layout's ``blocks``: which rows or columns of which HF tensor it is),
             split by rows so that no part exceeds the bucket (a part holds one row at least).
    bucket   consecutive entries whose HF tensors, plus the staging room of their packed parts, fit in
             ``bucket_bytes`` (an entry larger than that is a bucket of its own). A bucket is laid out as one
             range of elements: the entries' HF tensors one after the other (what the destination yields views
             of; a tensor of fp32 bits in a 2-byte stream starts at an even element, one unused element before
             it where needed), then, from ``Bucket.stage`` on, the staging room of the packed parts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..families import family_of
from ..model.sharding import make_layout
from ..model.table import expected_hf_shapes, row_dtype


class TensorMeta(NamedTuple):
    """One tensor of the export stream: its HF name, dtype and full shape (what ``export_hf_tensors`` yields, in
    the same order; ``parallm.export_metadata``)."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Part:
    """Rows ``[row_start, row_stop)`` x columns ``[col_start, col_stop)`` of TP rank ``tp``'s shard (seen as 2-D:
    ``[rows, -1]``) of entry ``entry``, sent by global rank ``src``. In HF tensor ``hf`` of the entry (an index
    into its names, seen as 2-D too) they land at rows ``[hf_start, hf_start + rows)`` (``dim`` 0: whole rows),
    or at rows ``[row_start, row_stop)`` x columns ``[hf_start, hf_start + cols)`` (``dim`` 1: a column block of
    a row-parallel weight). ``offset``: where the part lies in the bucket's range (a direct part: its place in
    the HF tensor; a packed one: in its sender's staging segment). ``direct``: it travels alone, straight into
    its place, rather than packed with the sender's other parts."""
    entry: int
    hf: int
    tp: int
    src: int
    dim: int
    row_start: int
    row_stop: int
    col_start: int
    col_stop: int
    hf_start: int
    direct: bool = False
    offset: int = 0

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def cols(self) -> int:
        return self.col_stop - self.col_start

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Bucket:
    outputs: tuple[tuple[int, int, int], ...]     # (entry, hf index, offset) of each HF tensor, in order
    parts: tuple[Part, ...]
    segments: tuple[tuple[int, int, int], ...]    # (src, offset, numel) of each sender's packed parts
    numel: int                                    # the HF tensors, then the staging room
    placing: tuple[tuple[Part, ...], ...] = ()    # per output: the packed parts to copy into it
    stage: int = 0                                # where the staging room starts (= the HF tensors' numel)

    def messages(self) -> list[tuple[int, int, int]]:
        """``(src, offset, numel)`` of every message, in the order every rank issues them: the packed segments
        (by sender), then the direct parts (in plan order)."""
        return list(self.segments) + [(p.src, p.offset, p.numel) for p in self.parts if p.direct]


@dataclass(frozen=True)
class Plan:
    buckets: list[Bucket]
    names: dict[int, tuple[str, ...]]            # entry -> its HF names
    shapes: dict[str, tuple[int, ...]]
    # HF names whose fp32 bits travel as pairs of 2-byte wire elements (keep_fp32 rows in a bf16 / fp16 stream):
    # their planned shape has a last dim twice the real one; destinations view them back as float32
    fp32_bits: frozenset = frozenset()
    # the dtype each of those names is viewed back as (float32; int64 for an ``integer`` row, whose bits travel in a
    # stream of any dtype: int64 values are never converted)
    bit_dtypes: dict = dataclasses.field(default_factory=dict)

    def order(self) -> list[str]:
        """Every HF name, in the order the stream yields them."""
        return [self.names[e][k] for b in self.buckets for e, k, _ in b.outputs]


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _parts_of(entry: int, pieces, bucket_numel: int, direct_numel: int) -> list[Part]:
    """The parts of one entry: each primary block of each piece, split by rows into at most ``bucket_numel``
    elements (one row at least). ``pieces``: ``(tp, src, shard shape, blocks)``."""
    parts = []
    for tp, src, shape, blocks in pieces:
        rows = _rows(shape)
        width = math.prod(shape) // rows if rows else 0
        for block in blocks:
            if not block.primary or block.local_stop <= block.local_start:
                continue
            if block.dim == 0:      # whole rows of the shard and of the HF tensor
                r0, r1, c0, c1 = block.local_start, block.local_stop, 0, width
            elif len(shape) == 2:   # a column block: every row of the shard
                r0, r1, c0, c1 = 0, rows, block.local_start, block.local_stop
            else:
                raise RuntimeError(f"internal error: a column block of a {len(shape)}-D shard")
            per = max(1, bucket_numel // max(1, c1 - c0))
            for r in range(r0, r1, per):
                n = min(per, r1 - r)
                hf_start = block.hf_start + (r - r0) if block.dim == 0 else block.hf_start
                parts.append(Part(entry, block.source, tp, src, block.dim, r, r + n, c0, c1, hf_start,
                                  direct=block.dim == 0 and n * (c1 - c0) >= direct_numel))
    return parts


def plan_buckets(entries, bucket_numel: int, direct_numel: int, *, aligned=frozenset()) -> list[Bucket]:
    """``entries``: ``(entry, hf shapes, pieces)`` in global order (``pieces`` as :func:`_parts_of` takes them)
    -> buckets of at most ``bucket_numel`` elements, HF tensors and staging room together (an entry larger than
    that is a bucket of its own). ``aligned``: the ``(entry, hf index)`` of HF tensors that must start at an even
    element of the bucket (fp32 bits in a 2-byte stream: viewed as float32 at the destination, which needs a
    4-byte-aligned start); one element is skipped before one where needed. Pure."""
    buckets, current, used = [], [], 0
    for entry, hf_shapes, pieces in entries:
        parts = _parts_of(entry, pieces, bucket_numel, direct_numel)
        cost = sum(math.prod(s) + _ratio(aligned, (entry, k)) - 1 for k, s in enumerate(hf_shapes)) \
            + sum(p.numel for p in parts if not p.direct)
        if current and used + cost > bucket_numel:
            buckets.append(_layout_bucket(current, aligned))
            current, used = [], 0
        current.append((entry, hf_shapes, parts))
        used += cost
    if current:
        buckets.append(_layout_bucket(current, aligned))
    return buckets


def _ratio(aligned, key) -> int:
    """Wire elements per value of an HF tensor carried as bits: ``aligned`` a set (2: fp32 in a 2-byte stream)
    or a mapping to the ratio (int64: 8 bytes over the wire's element size)."""
    if isinstance(aligned, dict):
        return aligned.get(key, 1)
    return 2 if key in aligned else 1


def _layout_bucket(entries, aligned=frozenset()) -> Bucket:
    outputs, places, offset = [], {}, 0
    for entry, hf_shapes, _ in entries:
        for k, shape in enumerate(hf_shapes):
            r = _ratio(aligned, (entry, k))
            if offset % r:
                offset += r - offset % r    # elements no tensor uses: the next one starts aligned for its view
            outputs.append((entry, k, offset))
            places[(entry, k)] = (offset, math.prod(shape) // _rows(shape) if math.prod(shape) else 0)
            offset += math.prod(shape)
    stage = offset
    parts = [p for _, _, ps in entries for p in ps]
    laid, packed = [], []
    for k, p in enumerate(parts):
        if p.direct:
            start, width = places[(p.entry, p.hf)]
            laid.append(dataclasses.replace(p, offset=start + p.hf_start * width))
        else:
            packed.append((p.src, k, p))
    segments = []
    for src, _, p in sorted(packed, key=lambda x: (x[0], x[1])):
        if not segments or segments[-1][0] != src:
            segments.append([src, offset, 0])
        laid.append(dataclasses.replace(p, offset=offset))
        offset += p.numel
        segments[-1][2] += p.numel
    placing = {(e, k): [] for e, k, _ in outputs}
    for p in laid:
        if not p.direct:
            placing[(p.entry, p.hf)].append(p)
    return Bucket(tuple(outputs), tuple(laid), tuple(tuple(s) for s in segments), offset,
                  tuple(tuple(placing[(e, k)]) for e, k, _ in outputs), stage)


def saved_entries(everything):
    """``(index into everything, entry)`` of every entry the stream carries, in stream order."""
    return [(i, e) for i, e in enumerate(everything) if e.row.save]


def stream_metadata(everything, spec, *, task: str, pp: int, dtype: torch.dtype) -> list[TensorMeta]:
    """What the stream yields, in order, without a plan or an exchange: the saved entries' HF tensors in entry
    order (buckets hold consecutive entries, each entry whole, its HF tensors in the entry's order). A
    ``keep_fp32`` row's tensors come in float32 whatever ``dtype``."""
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=pp)
    return [TensorMeta(name, row_dtype(e.row, dtype), shapes[name])
            for _, e in saved_entries(everything) for name in e.hf]


# the layouts whose shards a stream can carry as fp32 bits: seen as pairs of 2-byte elements, the shard of TP
# rank t is the t-th of tp equal pieces of the HF tensor's bits along dim 0 (copy: the whole tensor; column: rows
# [t n/tp, (t+1) n/tp) are elements [2 t n/tp, 2 (t+1) n/tp) of a 1-D tensor's bits, or those rows of a 2-D one's)
FP32_BIT_KINDS = ("copy", "column")


def bit_dtypes(everything, wire: torch.dtype) -> dict:
    """HF name -> the dtype whose raw bits a stream of ``wire`` elements carries for it: float32 for
    :func:`fp32_bit_names`, int64 for every ``integer`` row (DeepSeek-V4's ``tid2eid``: never converted, its
    bits travel as ``8 / wire.itemsize`` wire elements per value, the last dim multiplied by that)."""
    out = dict.fromkeys(fp32_bit_names(everything, wire), torch.float32)
    for _, e in saved_entries(everything):
        if e.row.integer:
            if e.row.kind not in FP32_BIT_KINDS:
                raise RuntimeError(f"internal error: integer row {e.row.local} has layout {e.row.kind!r}; its bits "
                                   f"can travel only in layouts {FP32_BIT_KINDS}")
            out.update(dict.fromkeys(e.hf, torch.int64))
    return out


def fp32_bit_names(everything, wire: torch.dtype) -> frozenset:
    """The HF names of ``keep_fp32`` rows that a stream of 2-byte ``wire`` elements carries as the raw bits of
    their fp32 values (two wire elements per value, the last dim doubled; the rows of :data:`FP32_BIT_KINDS`:
    replicated ones (the sigmoid router) and ones split along dim 0 (Gated DeltaNet's ``A_log``, by value
    heads), whose shards' bits are equal pieces of the tensor's bits). In an fp32 or fp64 stream they are
    converted like everything else (fp32 -> fp64 is exact)."""
    if torch.empty((), dtype=wire).element_size() >= 4:
        return frozenset()
    out = set()
    for _, e in saved_entries(everything):
        if e.row.keep_fp32:
            if e.row.kind not in FP32_BIT_KINDS:
                raise RuntimeError(f"internal error: keep_fp32 row {e.row.local} has layout {e.row.kind!r}; its "
                                   f"fp32 bits can travel only in layouts {FP32_BIT_KINDS}")
            out.update(e.hf)
    return frozenset(out)


def make_plan(tp_of, dp_of, held, everything, *, world: int, tp: int, pp: int, spec, task: str,
              padded_vocab: int, numel: int, direct_numel: int, wire: torch.dtype = torch.float32) -> Plan:
    """The export plan. ``tp_of[r]`` / ``dp_of[r]``: rank r's TP and data-parallel rank; ``held[r][i]``: whether
    rank r holds entry i of ``everything`` (every rank's row of the exchange); ``wire``: the stream's dtype
    (:func:`fp32_bit_names` travel as pairs of its elements)."""
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=pp)
    kinds = bit_dtypes(everything, wire)
    bits = frozenset(kinds)
    size = torch.empty((), dtype=wire).element_size()
    ratio = {n: torch.empty((), dtype=d).element_size() // size for n, d in kinds.items()}
    shapes = {n: (s[:-1] + (ratio[n] * s[-1],) if n in bits else s) for n, s in shapes.items()}
    entries, names, aligned = [], {}, {}
    for i, entry in saved_entries(everything):
        aligned.update(((i, k), ratio[n]) for k, n in enumerate(entry.hf) if n in bits)
        hf_shapes = [shapes[n] for n in entry.hf]
        tp_layout = make_layout(entry.row.kind, spec, padded_vocab)
        pieces = []
        for t in (range(tp) if tp_layout.tp_dim is not None else [0]):   # replicated: TP rank 0's copy
            holders = [r for r in range(world) if held[r][i] and tp_of[r] == t]
            if not holders:
                raise RuntimeError(f"internal error: no rank holds TP rank {t}'s shard of {', '.join(entry.hf)}")
            src = min(holders, key=lambda r: (dp_of[r], r))
            pieces.append((t, src, tp_layout.shard_shape(t, tp, hf_shapes), tp_layout.blocks(t, tp, hf_shapes)))
        entries.append((i, hf_shapes, pieces))
        names[i] = tuple(entry.hf)
    return Plan(plan_buckets(entries, numel, direct_numel, aligned=aligned), names, shapes, bits, kinds)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A shard or HF tensor seen as 2-D ``[rows, -1]`` (1-D: one element per row)."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def place(parts, target: torch.Tensor, staging: torch.Tensor, base: int = 0) -> None:
    """Copy packed ``parts`` into their places in HF tensor ``target`` (direct parts are there already) from
    ``staging``, which holds the bucket's elements from ``base`` on (a part at ``offset`` is at
    ``offset - base`` in it)."""
    target = as_rows(target)
    for p in parts:
        rows = staging.narrow(0, p.offset - base, p.numel).view(p.rows, p.cols)
        if p.dim == 0:
            target.narrow(0, p.hf_start, p.rows).copy_(rows)
        else:
            target.narrow(0, p.row_start, p.rows).narrow(1, p.hf_start, p.cols).copy_(rows)
