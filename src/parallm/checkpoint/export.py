"""The export stream (weight sync): every HF tensor, exactly once, to the ranks that want it, in buckets.

``export_hf_tensors(chunks, *, dtype=None, bucket_bytes=..., dst_ranks=None)`` is what an RL trainer calls to push
its weights into an inference engine: the destinations get one full HF-named tensor at a time; the other ranks
only send.

Plan (a pure function of one exchange, so every rank computes the same plan)
    piece    the shard of one TP rank of one saved table entry (``copy`` entries: TP rank 0's only), sent by
             the rank holding it with the lowest data-parallel rank. Pieces are found from what every rank
             holds (a bitmap over the global entry list), never from rank arithmetic, so entries owned by
             other kinds of ranks (expert-parallel experts) plan the same way.
    part     one block of a piece (the layout's ``blocks``: which rows or columns of which HF tensor it is),
             split by rows so that no part exceeds the bucket (a part holds one row at least).
    bucket   consecutive entries whose HF tensors, plus the staging room of their packed parts, fit in
             ``bucket_bytes`` (an entry larger than that is a bucket of its own). A bucket is one buffer: the
             entries' HF tensors laid out one after the other (what the destination yields views of), then the
             staging room.

Transfer, per bucket. A *direct* part (rows of an HF tensor, at least ``DIRECT_MIN_BYTES``) travels alone,
straight from the sender into its place in the destinations' HF tensors: no copy on arrival. The other parts
(small tensors; column slices of row-parallel weights, which interleave in the HF tensor) are *packed*: each sender
copies its packed parts into its own contiguous segment of the staging room, one message per sender, and every
destination copies them into place. A sender converts to the wire dtype in the copy that packs (a rank that is
not a destination sends direct parts straight from its parameters when no conversion is needed). When every rank
is a destination the messages are broadcasts over the world, else point-to-point sends to each destination.

Memory, independent of the model's size: a destination holds two bucket buffers (the consumer holds a tensor of
bucket k while bucket k+1 is in flight), each of at most ``max(bucket_bytes, the largest entry)``; a rank that is
not a destination holds at most two buffers of what it must pack for one bucket (nothing when it sends straight
from its parameters). Buffers stay with the model between calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..families import family_of
from ..model.decoder import as_chunks
from ..model.sharding import make_layout
from ..model.table import expected_hf_shapes
from ..parallel.errors import exchange_rows, gather_objects, raise_failures, status_of
from ..parallel.state import ParallelDims, dims_of, require_initialized
from .cast import WIRE_DTYPES, check_entry_casts
from .loader import held_params, model_entries
from .saver import parse_size

DEFAULT_BUCKET_BYTES = 64 * 1024 ** 2
DIRECT_MIN_BYTES = 4 * 1024 ** 2   # parts this large travel alone into their place; smaller ones are packed


@dataclass(frozen=True)
class Part:
    """Rows ``[s0, s1)`` x columns ``[c0, c1)`` of TP rank ``tp``'s shard (seen as 2-D: ``[rows, -1]``) of entry
    ``entry``, sent by global rank ``src``. They are, in HF tensor ``hf`` of the entry (index into its names),
    the rows starting at ``h0`` (``dim`` 0: whole rows), or rows ``[s0, s1)`` x the columns starting at ``h0``
    (``dim`` 1). ``offset``: where the part lies in the bucket buffer (a direct part: its place in the HF
    tensor; a packed one: in its sender's staging segment)."""
    entry: int
    hf: int
    tp: int
    src: int
    dim: int
    s0: int
    s1: int
    c0: int
    c1: int
    h0: int
    direct: bool = False
    offset: int = 0

    @property
    def numel(self) -> int:
        return (self.s1 - self.s0) * (self.c1 - self.c0)


@dataclass(frozen=True)
class Bucket:
    outputs: tuple[tuple[int, int, int], ...]     # (entry, hf index, offset) of each HF tensor, in order
    parts: tuple[Part, ...]
    segments: tuple[tuple[int, int, int], ...]    # (src, offset, numel) of each sender's packed parts
    numel: int                                    # the HF tensors, then the staging room
    placing: tuple[tuple[Part, ...], ...] = ()    # per output: the packed parts to copy into it

    def messages(self) -> list[tuple[int, int, int]]:
        """``(src, offset, numel)`` of every message, in the order every rank issues them: the packed segments
        (by sender), then the direct parts (in plan order)."""
        return list(self.segments) + [(p.src, p.offset, p.numel) for p in self.parts if p.direct]


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _parts_of(entry: int, pieces, bucket_numel: int, direct_numel: int) -> list[Part]:
    """The parts of one entry: each primary block of each piece, split by rows into at most ``bucket_numel``
    elements (one row at least). ``pieces``: ``(tp, src, shard shape, blocks)``."""
    parts = []
    for tp, src, shape, blocks in pieces:
        rows = _rows(shape)
        width = math.prod(shape) // rows if rows else 0
        for source, dim, a, b, la, lb, primary in blocks:
            if not primary or lb <= la:
                continue
            if dim == 0:
                r0, r1, c0, c1, h = la, lb, 0, width, a
            elif len(shape) == 2:
                r0, r1, c0, c1, h = 0, rows, la, lb, a
            else:
                raise RuntimeError(f"internal error: a column block of a {len(shape)}-D shard")
            per = max(1, bucket_numel // max(1, c1 - c0))
            for r in range(r0, r1, per):
                n = min(per, r1 - r)
                parts.append(Part(entry, source, tp, src, dim, r, r + n, c0, c1, h + (r - r0) if dim == 0 else h,
                                  direct=dim == 0 and n * (c1 - c0) >= direct_numel))
    return parts


def plan_buckets(entries, bucket_numel: int, direct_numel: int) -> list[Bucket]:
    """``entries``: ``(entry, hf shapes, pieces)`` in global order (``pieces`` as :func:`_parts_of` takes them)
    -> buckets of at most ``bucket_numel`` elements, HF tensors and staging room together (an entry larger than
    that is a bucket of its own). Pure."""
    buckets, current, used = [], [], 0
    for entry, hf_shapes, pieces in entries:
        parts = _parts_of(entry, pieces, bucket_numel, direct_numel)
        cost = sum(math.prod(s) for s in hf_shapes) + sum(p.numel for p in parts if not p.direct)
        if current and used + cost > bucket_numel:
            buckets.append(_layout_bucket(current))
            current, used = [], 0
        current.append((entry, hf_shapes, parts))
        used += cost
    if current:
        buckets.append(_layout_bucket(current))
    return buckets


def _layout_bucket(entries) -> Bucket:
    outputs, places, offset = [], {}, 0
    for entry, hf_shapes, _ in entries:
        for k, shape in enumerate(hf_shapes):
            outputs.append((entry, k, offset))
            places[(entry, k)] = (offset, math.prod(shape) // _rows(shape) if math.prod(shape) else 0)
            offset += math.prod(shape)
    parts = [p for _, _, ps in entries for p in ps]
    laid, packed = [], []
    for k, p in enumerate(parts):
        if p.direct:
            start, width = places[(p.entry, p.hf)]
            laid.append(dataclasses.replace(p, offset=start + p.h0 * width))
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
                  tuple(tuple(placing[(e, k)]) for e, k, _ in outputs))


def _parse_bucket(bucket_bytes) -> int:
    try:
        n = parse_size(bucket_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"export_hf_tensors: bucket_bytes must be a size in bytes, got {bucket_bytes!r}") from None
    if n < 1:
        raise ValueError(f"export_hf_tensors: bucket_bytes must be at least 1 byte, got {bucket_bytes!r}")
    return n


def _parse_dst(dst_ranks, world: int) -> list[int]:
    if dst_ranks is None:
        return list(range(world))
    try:
        ranks = sorted({int(r) for r in dst_ranks})
    except (TypeError, ValueError):
        raise ValueError(f"export_hf_tensors: dst_ranks must be a list of global ranks, got {dst_ranks!r}") \
            from None
    outside = [r for r in ranks if not 0 <= r < world]
    if outside or not ranks:
        raise ValueError(f"export_hf_tensors: dst_ranks {list(dst_ranks)} " + (
            f"name rank(s) {outside} outside the world of {world} ranks (0..{world - 1})" if outside
            else "is empty: name at least one destination rank"))
    return ranks


def export_hf_tensors(chunks, *, dtype: torch.dtype | None = None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                      dst_ranks=None):
    """Every HF tensor of the model, once, in table order, as ``(hf_name, full tensor)`` on each rank of
    ``dst_ranks`` (default: every rank). Collective: every rank calls it and iterates the returned generator
    to its end; on a rank that is not a destination the generator yields nothing and ends once this rank's
    part has been sent.

    ``dtype``: the tensors' dtype (default: the model's), converted on the sender while packing; a value the
    dtype cannot hold (e.g. > 65504 into float16) is a :class:`CheckpointError` on every rank, raised here
    before anything is sent. ``bucket_bytes`` (int, or "64MB" / "1GiB"): the most bytes one bucket carries;
    small tensors share a bucket; a tensor larger than that is a bucket of its own, sent in messages of at most
    ``bucket_bytes``.

    Yielded tensors live on the parameters' device, are never views of a parameter, and may be kept: they are
    views of the stream's output buffers, and a buffer is reused for later tensors only once nothing refers
    to it any more (a consumer that copies each tensor and drops it, as an inference engine's weight loader
    does, lets the stream reuse its buffers; one that keeps them makes the stream allocate afresh). The
    memory bound is in the module docstring.

    Arguments are checked on every rank in the call's single exchange: a bucket below one byte, a destination
    outside the world, or ranks passing different arguments is a ``ValueError`` on every rank.
    """
    require_initialized("export_hf_tensors")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec = chunks[0].spec
    mine, everything = model_entries(chunks, layout)
    wire = dtype or chunks[0].config.params_dtype
    error, nbytes, numel, dst = None, 0, 0, []
    try:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"export_hf_tensors: dtype must be one of {[str(d) for d in WIRE_DTYPES]}, got {dtype}")
        nbytes = _parse_bucket(bucket_bytes)
        numel = max(1, nbytes // torch.empty((), dtype=wire).element_size())
        dst = _parse_dst(dst_ranks, layout.world)
        check_entry_casts(mine, wire, instead="export")   # before anything moves: everybody's error, not a hang
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the exchange
        error = e
    holds, params = held_params(mine, everything)
    dst_mask = [int(r in dst) for r in range(layout.world)]
    rows = exchange_rows([int(error is not None), nbytes, WIRE_DTYPES.index(wire) if wire in WIRE_DTYPES else -1,
                          layout.tp_rank, layout.dp_rank] + dst_mask + holds, what="export_hf_tensors", error=error)
    if rows[:, 0].any():
        statuses = gather_objects(status_of(error), what="export_hf_tensors", error=error)
        if error is not None:
            raise error
        raise_failures(statuses, what="export_hf_tensors")
    args = torch.cat([rows[:, 1:3], rows[:, 5:5 + layout.world]], dim=1)
    if not bool((args == args[0]).all()):
        differ = [r for r in range(layout.world) if not bool((args[r] == args[0]).all())]
        raise ValueError(f"export_hf_tensors: every rank must pass the same dtype, bucket_bytes and dst_ranks; "
                         f"rank(s) {differ} differ from rank 0")
    direct = max(1, DIRECT_MIN_BYTES // torch.empty((), dtype=wire).element_size())
    key = (torch.cat([rows[:, 1:5], rows[:, 5 + layout.world:]], dim=1).numpy().tobytes(), direct)  # not dst_ranks
    cache = getattr(chunks[0], "_parallm_export", None)
    if cache is None:
        cache = chunks[0]._parallm_export = {"plans": {}, "buffers": _Buffers()}   # kept with the model
    plan = cache["plans"].get(key)
    if plan is None:
        plan = _make_plan(rows, everything, layout, spec, chunks[0].task, chunks[0].padded_vocab_size, numel,
                          direct)
        if len(cache["plans"]) >= 4:
            cache["plans"].pop(next(iter(cache["plans"])))
        cache["plans"][key] = plan
    device = next(chunks[0].parameters()).device
    return _stream(plan, cache["buffers"], params, dst, wire, device, layout)




@dataclass(frozen=True)
class Plan:
    buckets: list[Bucket]
    names: dict[int, tuple[str, ...]]            # entry -> its HF names
    shapes: dict[str, tuple[int, ...]]


def _make_plan(rows, everything, layout: ParallelDims, spec, task, padded_vocab: int, numel: int,
               direct_numel: int) -> Plan:
    """The export plan from the exchange's rows (every rank computes the same)."""
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=layout.pp)
    tp_of, dp_of, held = rows[:, 3].tolist(), rows[:, 4].tolist(), rows[:, 5 + layout.world:]
    entries, names = [], {}
    for i, entry in enumerate(everything):
        if not entry.row.save:
            continue
        hf_shapes = [shapes[n] for n in entry.hf]
        tp_layout = make_layout(entry.row.kind, spec, padded_vocab)
        pieces = []
        for t in (range(layout.tp) if tp_layout.tp_dim is not None else [0]):   # replicated: TP rank 0's copy
            holders = [r for r in range(layout.world) if held[r, i] and tp_of[r] == t]
            if not holders:
                raise RuntimeError(f"internal error: no rank holds TP rank {t}'s shard of {', '.join(entry.hf)}")
            src = min(holders, key=lambda r: (dp_of[r], r))
            pieces.append((t, src, tp_layout.shard_shape(t, layout.tp, hf_shapes),
                           tp_layout.blocks(t, layout.tp, hf_shapes)))
        entries.append((i, hf_shapes, pieces))
        names[i] = tuple(entry.hf)
    return Plan(plan_buckets(entries, numel, direct_numel), names, shapes)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A shard or HF tensor seen as 2-D ``[rows, -1]`` (1-D: one element per row)."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def _source(params, p: Part) -> torch.Tensor:
    return _as_rows(params[p.entry].detach())[p.s0:p.s1, p.c0:p.c1]


def _pack(bucket: Bucket, buf: torch.Tensor, params, me: int) -> None:
    """Copy (converting to ``buf``'s dtype) this rank's parts of ``bucket`` into their places in ``buf``."""
    with torch.no_grad():
        for p in bucket.parts:
            if p.src == me:
                buf.narrow(0, p.offset, p.numel).view(p.s1 - p.s0, p.c1 - p.c0).copy_(_source(params, p))


def _place(parts, target: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy packed ``parts`` from the staging room of ``buf`` into their places in HF tensor ``target`` (direct
    parts are there already)."""
    target = _as_rows(target)
    for p in parts:
        rows = buf.narrow(0, p.offset, p.numel).view(p.s1 - p.s0, p.c1 - p.c0)
        if p.dim == 0:
            target.narrow(0, p.h0, p.s1 - p.s0).copy_(rows)
        else:
            target.narrow(0, p.s0, p.s1 - p.s0).narrow(1, p.h0, p.c1 - p.c0).copy_(rows)


def _transfer(messages, views, dst: list[int], world: int, me: int) -> list:
    """Start every message (``(src, offset, numel)``, with ``views[k]`` the tensor to send or receive into):
    broadcasts when every rank is a destination, else point-to-point sends from each sender to each
    destination. Returns the pending works."""
    works = []
    if world == 1:
        return works
    for (src, _, _), view in zip(messages, views):
        if len(dst) == world:
            works.append(dist.broadcast(view, src=src, async_op=True))
        elif src == me:
            works += [dist.isend(view, dst=d) for d in dst if d != me]
        elif me in dst:
            works.append(dist.irecv(view, src=src))
    return works


def _wait(works) -> None:
    for w in works:
        w.wait()


class _Pool:
    """Buffers handed out as views and reused only once nothing refers to them any more: a consumer may keep a
    yielded tensor (its buffer is then left to it and the pool allocates afresh). A consumer that drops each
    tensor settles the pool at two buffers (the bucket it is reading, the one in flight)."""

    _use_count = getattr(torch._C, "_storage_Use_Count", None)

    def __init__(self, numel: int, dtype, device, keep: int = 3):
        self.numel, self.dtype, self.device, self.keep = numel, dtype, device, keep
        self.free_at: list[tuple[torch.Tensor, int]] = []    # (buffer, its use count when nothing else holds it)

    def get(self) -> torch.Tensor:
        if self._use_count is not None:
            for t, baseline in self.free_at:
                if self._use_count(t.untyped_storage()._cdata) == baseline:
                    return t
        t = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self._use_count is not None:
            self.free_at = self.free_at[-(self.keep - 1):] + [(t, self._use_count(t.untyped_storage()._cdata))]
        return t


class _Buffers:
    """The stream's buffers, kept with the model between calls (a weight sync runs every step, and on CPU fresh
    memory costs a page fault per page): per dtype, the destinations' bucket pool (handed out, reused only when
    free) and the senders' packing buffers (internal)."""

    def __init__(self):
        self.bufs, self.pools = {}, {}

    def packing(self, numel: int, dtype, device, slot: int) -> torch.Tensor:
        buf = self.bufs.get((dtype, device, slot))
        if buf is None or buf.numel() < numel:
            self.bufs[(dtype, device, slot)] = buf = None
            self.bufs[(dtype, device, slot)] = buf = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def pool(self, numel: int, dtype, device) -> _Pool:
        p = self.pools.get((dtype, device))
        if p is None or p.numel < numel:
            p = self.pools[(dtype, device)] = _Pool(numel, dtype, device)
        return p


def _send_only(plan: Plan, buffers: _Buffers, params, dst, wire, device, layout: ParallelDims) -> None:
    """A rank that is not a destination: send its parts of each bucket, at most two buckets in flight. A direct
    part goes straight from the parameter when it needs no conversion; everything else is packed."""
    me, flying, slot = layout.rank, [], 0
    for bucket in plan.buckets:
        messages = [m for m in bucket.messages() if m[0] == me]
        if not messages:
            continue
        if len(flying) == 2:
            _wait(flying.pop(0))
        straight = {p.offset: _source(params, p) for p in bucket.parts
                    if p.src == me and p.direct and params[p.entry].dtype == wire}
        straight = {k: v for k, v in straight.items() if v.is_contiguous()}
        packed = [p for p in bucket.parts if p.src == me and (not p.direct or p.offset not in straight)]
        buf = buffers.packing(sum(p.numel for p in packed), wire, device, slot)
        slot = 1 - slot
        local, at = {}, 0
        with torch.no_grad():
            for p in packed:
                buf.narrow(0, at, p.numel).view(p.s1 - p.s0, p.c1 - p.c0).copy_(_source(params, p))
                local[p.offset] = at
                at += p.numel
        views = []
        for _, offset, n in messages:
            if offset in straight:
                views.append(straight[offset].reshape(-1))
            else:          # a packed segment (its parts are consecutive) or a converted direct part
                views.append(buf.narrow(0, local[offset], n))
        flying.append(_transfer(messages, views, dst, layout.world, me))
    for works in flying:
        _wait(works)


def _stream(plan: Plan, buffers: _Buffers, params, dst, wire, device, layout: ParallelDims):
    """A destination: bucket k+1 is packed and in flight while bucket k's tensors are placed (packed parts copied
    into them) and read by the consumer; it starts once the consumer has taken bucket k's first tensor, so that
    it no longer holds bucket k-1's last one (two buffers)."""
    me = layout.rank
    if me not in dst:
        _send_only(plan, buffers, params, dst, wire, device, layout)
        return
    buckets = plan.buckets
    pool = buffers.pool(max((b.numel for b in buckets), default=0), wire, device)

    def start(k):
        bucket, buf = buckets[k], pool.get()
        _pack(bucket, buf, params, me)
        messages = bucket.messages()
        works = _transfer(messages, [buf.narrow(0, off, n) for _, off, n in messages], dst, layout.world, me)
        return buf, works

    pending = start(0) if buckets else None
    for k, bucket in enumerate(buckets):
        buf, works = pending
        pending = None
        _wait(works)
        works = None
        for (entry, hf, offset), parts in zip(bucket.outputs, bucket.placing):
            name = plan.names[entry][hf]
            shape = plan.shapes[name]
            tensor = buf.narrow(0, offset, math.prod(shape)).view(shape)
            _place(parts, tensor, buf)     # tensor by tensor: after the first, overlapped with bucket k+1
            yield name, tensor
            tensor = None
            if pending is None and k + 1 < len(buckets):
                pending = start(k + 1)
        buf = None
        if pending is None and k + 1 < len(buckets):
            pending = start(k + 1)
