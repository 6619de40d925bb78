"""The export stream's transfer machinery (:mod:`.export` is the public side: the contract, the agreement and the
plan's cache): the buffers kept with the model, the fences that order their reuse, packing and sending a bucket's
parts, and the generator that runs a plan on every rank (destinations assemble and yield, the others send)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import ParallelError
from ..parallel.errors import exchange_rows, gather_objects, remote_error, status_of
from ..parallel.state import ParallelDims
from .export_plan import Bucket, Plan, as_rows, place

# -- the buffers -------------------------------------------------------------------------------------------------

class _Buffers:
    """The stream's buffers, kept with the model between calls (a weight sync runs every step, and on CPU fresh
    memory costs a page fault per page): per (dtype, device) and slot 0 / 1, a destination's output buffer (the
    HF tensors it yields views of) and staging buffer, and a sender's packing buffer. ``take()`` hands them to
    one stream at a time; a second stream open at once gets buffers of its own."""

    def __init__(self):
        self.bufs = {}
        self.busy = False

    def take(self) -> "_Buffers":
        if self.busy:
            return _Buffers()
        self.busy = True
        return self

    def release(self) -> None:
        self.busy = False

    def get(self, kind: str, slot: int, numel: int, dtype, device) -> torch.Tensor:
        key = (kind, dtype, device, slot)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < numel:
            self.bufs[key] = buf = None                      # the old one goes before the new one comes
            self.bufs[key] = buf = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def count(self, kind: str) -> int:
        return sum(1 for k in self.bufs if k[0] == kind)


class _Fence:
    """CUDA only: an event per buffer slot, recorded on the consumer's current stream when it releases the
    slot's tensors (asks for the next item), waited for by the current stream before the slot is written
    again."""

    def __init__(self, device):
        self.on = getattr(device, "type", str(device)) == "cuda"
        self.events = {}

    def release(self, slot: int) -> None:
        if self.on:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.events[slot] = ev

    def acquire(self, slot: int) -> None:
        ev = self.events.pop(slot, None)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


# -- the transfer -------------------------------------------------------------------------------------------------

def _source(params, p) -> torch.Tensor:
    return as_rows(params[p.entry].detach())[p.row_start:p.row_stop, p.col_start:p.col_stop]


def _at(bucket: Bucket, out: torch.Tensor, staging: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """Elements ``[offset, offset + numel)`` of the bucket's range: in ``out`` below ``bucket.stage``, else in
    ``staging``."""
    if offset < bucket.stage:
        return out.narrow(0, offset, numel)
    return staging.narrow(0, offset - bucket.stage, numel)


def _pack(bucket: Bucket, out, staging, params, me: int) -> None:
    """Copy (converting to the buffers' dtype) this rank's parts of ``bucket`` into their places."""
    with torch.no_grad():
        for p in bucket.parts:
            if p.src == me:
                _at(bucket, out, staging, p.offset, p.numel).view(p.rows, p.cols).copy_(_source(params, p))


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


# -- the protocol that ends a stream on every rank -------------------------------------------------------------------

_STOPPED = "stopped"


class _StreamState:
    """Where one rank's stream is: how many of the per-bucket agreements it has made (every rank makes them in
    the same order: agreement k comes before bucket k's messages), its transfers still in flight, how many
    tensors it has yielded, and whether the stream has ended for the other ranks."""

    def __init__(self, what: str, layout: ParallelDims, plan: Plan):
        self.what, self.world, self.rank = what, layout.world, layout.rank
        self.buckets = len(plan.buckets)
        self.tensors = sum(len(b.outputs) for b in plan.buckets)
        self.agreed = 0           # agreements made
        self.pending = []         # lists of works still in flight
        self.yielded = 0
        self.ended = False        # no agreement may follow (the stream is over for every rank)
        self.exchanged = False    # the stream ended early through an agreement (every rank knows)

    def wait_pending(self) -> None:
        while self.pending:
            _wait(self.pending.pop(0))

    def go_on(self) -> None:
        """Agreement ``self.agreed``: every rank says whether it goes on. Raises on this rank when another has
        stopped or failed."""
        if self.world == 1:
            self.agreed += 1
            return
        self.ended = True                  # a lost peer inside ends the protocol too
        rows = exchange_rows([0], what=self.what)
        self.agreed += 1
        if not rows.any():
            self.ended = False
            return
        self.exchanged = True
        statuses = gather_objects(None, what=self.what)
        self.wait_pending()
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if all(s[0] == _STOPPED for _, s in failed):
            raise ParallelError(f"{self.what}: rank {failed[0][0]} stopped reading the stream "
                                f"({failed[0][1][1]}); the stream ended on every rank")
        raise remote_error(self.what, [(r, s) for r, s in failed if s[0] != _STOPPED])

    def stop(self, status) -> None:
        """This rank stops (``status``: ``status_of(error)``, or ``(_STOPPED, how far it read)``): its transfers
        in flight complete, and the other ranks learn of it at the agreement they are waiting in. Nothing to
        tell when every bucket is already under way (the others end by themselves)."""
        if self.ended:
            return
        self.ended = True
        self.wait_pending()
        if self.world == 1 or self.agreed >= self.buckets:
            return
        self.exchanged = True
        exchange_rows([1], what=self.what)
        gather_objects(status, what=self.what)


def _run(plan: Plan, cache: _Buffers, params, dst, wire, device, layout: ParallelDims, copy: bool,
         st: _StreamState, out_fn=None):
    buffers = cache.take()
    try:
        yield None                                   # primed by open_stream
        if layout.rank in dst:
            yield from _destination(plan, buffers, params, dst, wire, device, layout, copy, st, out_fn)
        else:
            _send_only(plan, buffers, params, dst, wire, device, layout, st)
        st.ended = True
    except GeneratorExit:                            # close(), or the generator was garbage-collected
        st.stop((_STOPPED, f"the generator was closed or dropped after {st.yielded} of {st.tensors} tensors"))
        raise
    except BaseException as e:                       # a failure here, or one the consumer threw in
        st.stop(status_of(e))
        raise
    finally:
        buffers.release()


def _send_only(plan: Plan, buffers: _Buffers, params, dst, wire, device, layout: ParallelDims,
               st: _StreamState) -> None:
    """A rank that is not a destination: send its parts of each bucket, at most two buckets in flight. A direct
    part goes straight from the parameter when it needs no conversion; everything else is packed."""
    me, slot = layout.rank, 0
    for bucket in plan.buckets:
        messages = [m for m in bucket.messages() if m[0] == me]
        if messages and len(st.pending) == 2:
            _wait(st.pending.pop(0))                 # frees the packing buffer of this slot
        views = []
        if messages:
            straight = {p.offset: _source(params, p) for p in bucket.parts
                        if p.src == me and p.direct and params[p.entry].dtype == wire}
            straight = {k: v for k, v in straight.items() if v.is_contiguous()}
            packed = [p for p in bucket.parts if p.src == me and (not p.direct or p.offset not in straight)]
            buf = buffers.get("packing", slot, sum(p.numel for p in packed), wire, device)
            slot = 1 - slot
            local, at = {}, 0
            with torch.no_grad():
                for p in packed:
                    buf.narrow(0, at, p.numel).view(p.rows, p.cols).copy_(_source(params, p))
                    local[p.offset] = at
                    at += p.numel
            for _, offset, n in messages:
                if offset in straight:
                    views.append(straight[offset].reshape(-1))
                else:      # a packed segment (its parts are consecutive) or a converted direct part
                    views.append(buf.narrow(0, local[offset], n))
        st.go_on()
        if messages:
            st.pending.append(_transfer(messages, views, dst, layout.world, me))
    st.wait_pending()


def _consumer_buffer(out_fn, k: int, numel: int, wire, device) -> torch.Tensor:
    """``out_fn(k, numel)`` checked: a contiguous 1-D tensor of ``wire`` on ``device`` (or in host memory) with at
    least ``numel`` elements; its first ``numel``."""
    buf = out_fn(k, numel)
    if not (isinstance(buf, torch.Tensor) and buf.dim() == 1 and buf.is_contiguous() and buf.dtype == wire
            and buf.device in (torch.device(device), torch.device("cpu")) and buf.numel() >= numel):
        got = (f"{tuple(buf.shape)} {buf.dtype} on {buf.device}, contiguous={buf.is_contiguous()}"
               if isinstance(buf, torch.Tensor) else type(buf).__name__)
        raise ValueError(f"export_hf_tensors: out({k}, {numel}) must return a contiguous 1-D {wire} tensor on "
                         f"{device} (or on the host) of at least {numel} elements; it returned {got}")
    return buf[:numel]


def _staged(buf: torch.Tensor, device) -> bool:
    """Whether a consumer's ``out`` buffer is host memory for a model on an accelerator: the bucket is then
    assembled in the stream's own device buffer and copied into ``out`` once complete."""
    return buf.device != torch.device(device)


def _destination(plan: Plan, buffers: _Buffers, params, dst, wire, device, layout: ParallelDims, copy: bool,
                 st: _StreamState, out_fn=None):
    """A destination: bucket k+1 is packed and in flight while bucket k's tensors are placed and read by the
    consumer. It starts once the consumer asks for bucket k's first tensor, so that it no longer holds bucket
    k-1's, whose buffer k+1 reuses (two buffers)."""
    me, buckets = layout.rank, plan.buckets
    fence = _Fence(device)
    out_numel = max((b.stage for b in buckets), default=0)
    stage_numel = max((b.numel - b.stage for b in buckets), default=0)

    def start(k):
        bucket, slot = buckets[k], k % 2
        fence.acquire(slot)
        host = None
        if out_fn is not None:                       # the consumer's memory, written in place
            out = _consumer_buffer(out_fn, k, bucket.stage, wire, device)
            if _staged(out, device):                 # host memory: assembled on the device, copied at the end
                host, out = out, buffers.get("output", slot, out_numel, wire, device)
        else:
            out = (torch.empty(bucket.stage, dtype=wire, device=device) if copy  # the consumer's own memory
                   else buffers.get("output", slot, out_numel, wire, device))
        staging = buffers.get("staging", slot, stage_numel, wire, device)
        _pack(bucket, out, staging, params, me)
        st.go_on()
        messages = bucket.messages()
        works = _transfer(messages, [_at(bucket, out, staging, off, n) for _, off, n in messages], dst,
                          layout.world, me)
        st.pending.append(works)
        return out, staging, host

    pending = start(0) if buckets else None
    for k, bucket in enumerate(buckets):
        out, staging, host = pending
        if k >= 1:
            fence.release((k - 1) % 2)               # the consumer asked for this bucket: done with k-1
        pending = start(k + 1) if k + 1 < len(buckets) else None
        _wait(st.pending.pop(0))                     # bucket k's messages
        placed = []
        for (entry, hf, offset), parts in zip(bucket.outputs, bucket.placing):
            name = plan.names[entry][hf]
            shape = plan.shapes[name]
            place(parts, out.narrow(0, offset, math.prod(shape)).view(shape), staging, base=bucket.stage)
            placed.append((name, offset, shape))
        if host is not None:    # device -> host after the placing copies on the current stream; copy_ into host
            host.copy_(out[:bucket.stage])          # memory returns once the bytes are there (pinned or not)
            out = host
        tensors = []
        for name, offset, shape in placed:
            tensor = out.narrow(0, offset, math.prod(shape)).view(shape)
            tensors.append((name, tensor.view(plan.bit_dtypes.get(name, torch.float32)) if name in plan.fp32_bits
                            else tensor))
        out = staging = host = None
        for item in tensors:
            st.yielded += 1
            yield item
        tensors = item = None
