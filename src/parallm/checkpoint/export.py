"""The export stream (weight sync): every HF tensor, exactly once, to the ranks that want it, in buckets.

``export_hf_tensors(chunks, *, dtype=None, bucket_bytes=..., dst_ranks=None)`` is what an RL trainer calls to push
its weights into an inference engine: the destinations get one full HF-named tensor at a time; the other ranks
only send.

Plan (a pure function of one exchange, so every rank computes the same plan)
    piece    the shard of one TP rank of one saved table entry (``copy`` entries: TP rank 0's only), sent by
             the rank holding it with the lowest data-parallel rank. Pieces are found from what every rank
             holds (a bitmap over the global entry list), never from rank arithmetic, so entries owned by
             other kinds of ranks (expert-parallel experts) plan the same way.
    part     a piece split by rows so that no part exceeds the bucket (a part holds one row at least).
    bucket   consecutive parts, at most ``bucket_bytes`` in all; inside a bucket the parts of each sending
             rank are contiguous (its segment), so a bucket costs one message per sending rank.

Transfer, per bucket: each sender copies its parts into its segment, converting to the wire dtype in that copy;
then one broadcast per segment over the world when every rank is a destination, else point-to-point sends to
each destination. A destination assembles each HF tensor from its TP pieces (the layout's blocks, one copy) and
yields it when its last part has arrived; a tensor larger than the bucket arrives over several buckets.

Memory, independent of the model's size: a destination holds two bucket buffers (bucket k+1 in flight while
bucket k is assembled), two output buffers (the consumer still holds the last tensor of the previous bucket when
it asks for the next) and the tensors that straddle buckets: about 4 buckets + twice the largest tensor; a rank
that is not a destination holds two buffers of its own segment. The buffers stay with the model between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..families import family_of
from ..model.decoder import as_chunks
from ..model.sharding import TensorSource, make_layout
from ..model.table import expected_hf_shapes
from ..parallel.errors import exchange_rows, gather_objects, remote_error, status_of
from ..parallel.state import ParallelDims, dims_of, require_initialized
from .cast import check_cast
from .loader import model_entries

DEFAULT_BUCKET_BYTES = 64 * 1024 ** 2
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Part:
    """Rows ``[r0, r1)`` of TP rank ``tp``'s shard of entry ``entry``, sent by global rank ``src``; in the
    bucket buffer at element ``offset``."""
    entry: int
    tp: int
    src: int
    r0: int
    r1: int
    row_numel: int
    offset: int = 0

    @property
    def numel(self) -> int:
        return (self.r1 - self.r0) * self.row_numel


@dataclass(frozen=True)
class Bucket:
    parts: tuple[Part, ...]                   # grouped by sender, each sender's parts contiguous
    segments: tuple[tuple[int, int, int], ...]  # (src, offset, numel) per sender
    numel: int


def piece_shape(tp_layout, tp_rank: int, tp: int, hf_shapes) -> tuple[int, ...]:
    """Shape of TP rank ``tp_rank``'s shard (from its layout, on the meta device: no data)."""
    metas = [TensorSource(torch.empty(s, device="meta")) for s in hf_shapes]
    return tuple(tp_layout.shard(metas, tp_rank, tp).shape)


def plan_buckets(pieces, bucket_numel: int) -> list[Bucket]:
    """``pieces``: ``(entry, tp, src, shape)`` in global order -> buckets of at most ``bucket_numel`` elements
    (a single row larger than that travels alone). Pure."""
    buckets, current, used = [], [], 0

    def close():
        nonlocal current, used
        if current:
            buckets.append(_layout_bucket(current))
        current, used = [], 0

    for entry, tp, src, shape in pieces:
        rows = shape[0] if shape else 1
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        r = 0
        while r < rows:
            room = (bucket_numel - used) // row_numel
            if room < 1 and current:
                close()
                continue
            n = min(rows - r, max(room, 1))
            current.append(Part(entry, tp, src, r, r + n, row_numel))
            used += n * row_numel
            r += n
            if used >= bucket_numel:
                close()
    close()
    return buckets


def _layout_bucket(parts: list[Part]) -> Bucket:
    order = sorted(range(len(parts)), key=lambda k: (parts[k].src, k))
    laid, segments, offset = [], [], 0
    for k in order:
        p = parts[k]
        if not segments or segments[-1][0] != p.src:
            segments.append([p.src, offset, 0])
        laid.append(Part(p.entry, p.tp, p.src, p.r0, p.r1, p.row_numel, offset))
        offset += p.numel
        segments[-1][2] += p.numel
    return Bucket(tuple(laid), tuple(tuple(s) for s in segments), offset)


def _parse_bucket(bucket_bytes) -> int:
    from .saver import parse_size
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
    small tensors share a bucket, larger ones are split over several.

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
        if wire not in _DTYPES:
            raise ValueError(f"export_hf_tensors: dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
        nbytes = _parse_bucket(bucket_bytes)
        numel = max(1, nbytes // torch.empty((), dtype=wire).element_size())
        dst = _parse_dst(dst_ranks, layout.world)
        for e, chunk in mine:      # before anything moves: an overflow is everybody's error, not a hang
            if e.row.save:
                check_cast(chunk.get_parameter(e.local).detach(), wire, e.hf, instead="export")
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the exchange
        error = e
    order = {(e.row, e.layer): i for i, e in enumerate(everything)}
    holds = [0] * len(everything)
    for e, _ in mine:
        holds[order[(e.row, e.layer)]] = 1
    dst_mask = [int(r in dst) for r in range(layout.world)]
    rows = exchange_rows([int(error is not None), nbytes, _DTYPES.index(wire) if wire in _DTYPES else -1,
                          layout.tp_rank, layout.dp_rank] + dst_mask + holds, what="export_hf_tensors", error=error)
    if rows[:, 0].any():
        statuses = gather_objects(status_of(error), what="export_hf_tensors", error=error)
        if error is not None:
            raise error
        raise remote_error("export_hf_tensors", [(r, s) for r, s in enumerate(statuses) if s is not None])
    args = torch.cat([rows[:, 1:3], rows[:, 5:5 + layout.world]], dim=1)
    if not bool((args == args[0]).all()):
        differ = [r for r in range(layout.world) if not bool((args[r] == args[0]).all())]
        raise ValueError(f"export_hf_tensors: every rank must pass the same dtype, bucket_bytes and dst_ranks; "
                         f"rank(s) {differ} differ from rank 0")
    key = torch.cat([rows[:, 1:5], rows[:, 5 + layout.world:]], dim=1).numpy().tobytes()   # all but dst_ranks
    cache = getattr(chunks[0], "_parallm_export", None)
    if cache is None:
        cache = chunks[0]._parallm_export = {"plans": {}, "buffers": _Buffers()}   # kept with the model
    plan = cache["plans"].get(key)
    if plan is None:
        plan = _make_plan(rows, everything, layout, spec, chunks[0].task, chunks[0].padded_vocab_size, numel)
        if len(cache["plans"]) >= 4:
            cache["plans"].pop(next(iter(cache["plans"])))
        cache["plans"][key] = plan
    params = {order[(e.row, e.layer)]: chunk.get_parameter(e.local) for e, chunk in mine}
    device = next(chunks[0].parameters()).device
    return _stream(plan, cache["buffers"], everything, params, dst, wire, device, layout)


@dataclass(frozen=True)
class Plan:
    buckets: list[Bucket]
    done: list[list[int]]          # per bucket: the entries whose last part it carries, in order
    straddle: frozenset[int]       # entries whose parts span several buckets
    outputs: dict[int, list]       # entry -> [(hf name, shape, arena offset)] (offset: None for straddlers)
    arena_numel: int               # room for the HF tensors completed by one bucket (straddlers apart)
    big_numel: int                 # room for the largest straddling entry's HF tensors
    shapes: dict[str, tuple[int, ...]]
    layouts: dict[int, object]     # entry -> its TP layout (the table row's kind)


def _make_plan(rows, everything, layout: ParallelDims, spec, task, padded_vocab: int, numel: int) -> Plan:
    """The export plan from the exchange's rows (every rank computes the same)."""
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=layout.pp)
    tp_of, dp_of, held = rows[:, 3].tolist(), rows[:, 4].tolist(), rows[:, 5 + layout.world:]
    pieces, layouts = [], {}
    for i, entry in enumerate(everything):
        if not entry.row.save:
            continue
        hf_shapes = [shapes[n] for n in entry.hf]
        tp_layout = layouts[i] = make_layout(entry.row.kind, spec, padded_vocab)
        for t in (range(layout.tp) if tp_layout.tp_dim is not None else [0]):   # replicated: TP rank 0's copy
            holders = [r for r in range(layout.world) if held[r, i] and tp_of[r] == t]
            if not holders:
                raise RuntimeError(f"internal error: no rank holds TP rank {t}'s shard of {', '.join(entry.hf)}")
            src = min(holders, key=lambda r: (dp_of[r], r))
            pieces.append((i, t, src, piece_shape(tp_layout, t, layout.tp, hf_shapes)))
    buckets = plan_buckets(pieces, numel)
    first, last = {}, {}
    for k, b in enumerate(buckets):
        for p in b.parts:
            first.setdefault(p.entry, k)
            last[p.entry] = k
    straddle = frozenset(i for i in first if first[i] != last[i])
    done = [[] for _ in buckets]
    for i in sorted(last):
        done[last[i]].append(i)
    outputs, arena = {}, 0
    for entries in done:
        offset = 0
        for i in entries:
            outputs[i] = []
            for name in everything[i].hf:
                n = 1
                for d in shapes[name]:
                    n *= d
                outputs[i].append((name, shapes[name], None if i in straddle else offset))
                offset += 0 if i in straddle else n
        arena = max(arena, offset)
    big = max((sum(_numel(shapes[n]) for n in everything[i].hf) for i in straddle), default=0)
    return Plan(buckets, done, straddle, outputs, arena, big, shapes, layouts)


def _pack(bucket: Bucket, buf: torch.Tensor, base: int, params, me: int, wire, everything) -> None:
    """Copy (and convert) this rank's parts of ``bucket`` into ``buf`` (whose element 0 is bucket offset
    ``base``)."""
    with torch.no_grad():
        for p in bucket.parts:
            if p.src != me:
                continue
            src = params[p.entry].detach()
            rows = src.reshape(src.shape[0] if src.dim() else 1, -1).narrow(0, p.r0, p.r1 - p.r0)
            buf.narrow(0, p.offset - base, p.numel).view(p.r1 - p.r0, p.row_numel).copy_(rows)


def _transfer(bucket: Bucket, buf: torch.Tensor, base: int, dst: list[int], world: int, me: int) -> list:
    """Start moving every segment of ``bucket`` to the destinations: a broadcast per segment when every rank
    is a destination, else point-to-point sends from each sender to each destination. Returns the pending
    works (wait on them before touching ``buf``)."""
    if len(dst) == world:
        works = [dist.broadcast(buf.narrow(0, off - base, n), src=src, async_op=True)
                 for src, off, n in bucket.segments if world > 1]
    else:
        works = []
        for src, off, n in bucket.segments:
            seg = buf.narrow(0, off - base, n)
            if src == me:
                works += [dist.isend(seg, dst=d) for d in dst if d != me]
            elif me in dst:
                works.append(dist.irecv(seg, src=src))
    return works


def _wait(works) -> None:
    for w in works:
        w.wait()


class _Pool:
    """Buffers handed out as views and reused only once nothing refers to them any more: a consumer may keep a
    yielded tensor (its buffer is then left to it and the pool allocates afresh). A consumer that drops each
    tensor still holds the last one in its loop variable while asking for the next, so a pool settles at two
    buffers (one being filled, one still seen by the consumer)."""

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
    memory costs a page fault per page): per dtype, the bucket buffer (internal) and the output pools (handed
    out, reused only when free)."""

    def __init__(self):
        self.bufs, self.pools = {}, {}

    def bucket(self, numel: int, dtype, device, slot: int) -> torch.Tensor:
        buf = self.bufs.get((dtype, device, slot))
        if buf is None or buf.numel() < numel:
            self.bufs[(dtype, device, slot)] = buf = None
            self.bufs[(dtype, device, slot)] = buf = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def pool(self, name: str, numel: int, dtype, device) -> "_Pool":
        p = self.pools.get((name, dtype, device))
        if p is None or p.numel < numel:
            p = self.pools[(name, dtype, device)] = _Pool(numel, dtype, device)
        return p


def _stream(plan: Plan, buffers: _Buffers, everything, params, dst, wire, device, layout: ParallelDims):
    """Two bucket buffers: bucket k+1 is packed and in flight while bucket k is assembled and yielded."""
    me = layout.rank
    buckets, shapes = plan.buckets, plan.shapes
    if me not in dst:
        mine = [(b, next(seg for seg in b.segments if seg[0] == me)) for b in buckets
                if any(s == me for s, _, _ in b.segments)]
        if not mine:
            return
        cap = max(seg[2] for _, seg in mine)
        bufs = [buffers.bucket(cap, wire, device, slot) for slot in (0, 1)]
        flying = []
        for k, (b, seg) in enumerate(mine):
            buf = bufs[k % 2]
            if len(flying) == 2:
                _wait(flying.pop(0))
            _pack(b, buf, seg[1], params, me, wire, everything)
            flying.append(_transfer(Bucket(b.parts, (seg,), b.numel), buf, seg[1], dst, layout.world, me))
        for works in flying:
            _wait(works)
        return
    cap = max((b.numel for b in buckets), default=0)
    bufs = [buffers.bucket(cap, wire, device, slot) for slot in (0, 1)]
    arena = buffers.pool("arena", plan.arena_numel, wire, device)
    bigs = buffers.pool("big", plan.big_numel, wire, device)   # entries assembled across buckets (two at most)

    def start(k):
        _pack(buckets[k], bufs[k % 2], 0, params, me, wire, everything)
        return _transfer(buckets[k], bufs[k % 2], 0, dst, layout.world, me)

    active: dict[int, dict] = {}
    out = None
    works = start(0) if buckets else []
    for k, b in enumerate(buckets):
        _wait(works)
        works = start(k + 1) if k + 1 < len(buckets) else []
        buf = bufs[k % 2]
        space = arena.get() if plan.arena_numel else None
        outs = {}
        for p in b.parts:
            if p.entry in plan.straddle:
                if p.entry not in active:
                    region, off, views = bigs.get(), 0, {}
                    for name, shape, _ in plan.outputs[p.entry]:
                        views[name] = region.narrow(0, off, _numel(shape)).view(shape)
                        off += _numel(shape)
                    active[p.entry] = views
                    region = views = None
                out = active[p.entry]
            else:
                out = outs.get(p.entry)
                if out is None:
                    out = outs[p.entry] = {name: space.narrow(0, off, _numel(shape)).view(shape)
                                           for name, shape, off in plan.outputs[p.entry]}
            _scatter(everything[p.entry], plan.layouts[p.entry], p, buf.narrow(0, p.offset, p.numel), out,
                     layout.tp, shapes)
        space = out = None
        for i in plan.done[k]:
            out = active.pop(i) if i in plan.straddle else outs.pop(i)
            for name in everything[i].hf:
                yield name, out.pop(name)
            out = None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _scatter(entry, tp_layout, part: Part, flat: torch.Tensor, out: dict, tp: int, shapes) -> None:
    """Copy a part (rows ``[r0, r1)`` of TP rank ``part.tp``'s shard) into its places in the HF tensors,
    following the layout's blocks; replicas (non-primary blocks) and vocab padding rows are skipped."""
    hf_shapes = [shapes[n] for n in entry.hf]
    rows = flat.view(part.r1 - part.r0, part.row_numel)
    for s, dim, a, b, la, lb, primary in tp_layout.blocks(part.tp, tp, hf_shapes):
        if not primary:
            continue
        target = out[entry.hf[s]]
        if dim == 0:
            lo, hi = max(la, part.r0), min(lb, part.r1)
            if lo < hi:
                target.view(target.shape[0] if target.dim() else 1, -1).narrow(0, a + lo - la, hi - lo).copy_(
                    rows.narrow(0, lo - part.r0, hi - lo))
        else:   # columns [la, lb) of the shard are columns [a, b) of the HF tensor, row for row
            target.narrow(0, part.r0, part.r1 - part.r0).narrow(1, a, b - a).copy_(rows.narrow(1, la, lb - la))
