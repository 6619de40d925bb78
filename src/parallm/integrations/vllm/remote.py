"""The push into engines in other processes: one export stream, fanned out to every engine of a
:class:`~parallm.integrations.vllm.client.Connection` (``push_weights(chunks, connection)``).

Every trainer rank runs the export stream with the connection's sending rank as its only destination (collective
at any tp / pp / vpp / ep / cp layout). On the sender the stream writes each bucket straight into one of two
slots (the shared-memory file of ``parallm_shm``; a buffer of the sender for ``parallm_gloo``) through the
stream's ``out`` hook: the sender's own rows are packed there, the other ranks' messages are received there (or,
for packed parts, copied from the stream's staging room into place): no temporary that is copied afterwards. A
finished bucket becomes one ``update_weights`` call per engine (each engine's calls on its own thread, in order;
for gloo with the slot's broadcast to the engine's group posted beside it) while the stream fills the other slot
with the next bucket. Before the stream writes into a slot again every engine has loaded it. Buckets default to
512 MiB here (``REMOTE_BUCKET_BYTES``; capped at the model's size), not the export stream's 64 MiB: each is a
round trip through every engine. From a model on an accelerator the slots are still host memory: the stream
assembles each bucket on the device and copies it into the slot once complete (``export_hf_tensors(out=...)``).

Around the stream, on every engine the push goes to: ``verify`` (names, shapes and dtype against the engine's
model, before anything changes), ``pause`` (a ``vllm serve`` engine lets its requests in flight end and holds new
ones: no request straddles the update, and no block of the prefix cache is in use), ``start_weight_update``;
after it ``finish_weight_update``, a prefix-cache reset whose result is checked (cached prompt prefixes hold keys
and values of the old weights; vLLM refuses while blocks are in use) and ``resume``.

Failures. A model that does not match raises on every rank and changes no engine. An engine that fails at any
step of this call (cannot be reached, does not answer within the connection's timeout, ``pause`` /
``start_weight_update`` / an update / ``finish`` raising, the prefix-cache reset refused, killed) is marked as
needing a restart (``conn.failed``), resumed if this push paused it (never left holding its callers' requests),
and dropped; the others receive every tensor and finish; then every rank
raises :class:`~parallm.integrations.vllm.client.EngineFailed` naming each engine that failed in this call (when
none could start, before the stream). Later pushes go to the other engines only. A failure of the trainer itself
during the stream (a rank's copy, the sender) ends the stream on every rank with that error; the engines that had
received part of the push are not finished (vLLM would build the layer it was loading from uninitialised memory),
stay paused and are marked ``conn.interrupted`` (listed in ``needs_restart``): the next push finishes their
interrupted update first (vLLM refuses to start an update over an open one), then sends them every tensor,
after which they are usable again. An engine that had
received nothing is finished with its old weights intact and resumed.
"""

from __future__ import annotations

import time

import torch

from ...checkpoint.cast import WIRE_DTYPES
from ...checkpoint.export import _parse_bucket, export_metadata, open_stream
from ...checkpoint.export_plan import saved_entries
from ...model.loaded import require_loaded
from ...model.table import model_entries
from ...parallel.errors import gather_objects, raise_failures, status_of
from ...parallel.state import as_chunks, dims_of
from .client import Connection, EngineFailed, wait_all
from .engines import EngineError

__all__ = ["push_remote"]

# A slot's size is rounded up to a multiple of this many bytes, so that slot k of the shared-memory file starts at
# such a boundary. Inside a slot the tensors lie where the export stream places them, back to back at element
# offsets (the export plan only skips an element where an fp32 row must start on 4 bytes, export_plan.py): no
# alignment beyond their dtype's is promised.
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Fanout:
    """The sender's side of one push: two slots used in turn, one per stream bucket. The export stream writes
    each bucket straight into its slot (``open_stream(..., out=fanout.slot_for)``: the sender's own rows are
    packed there, the other ranks' messages land there), so the slot is the one copy on the sender; a finished
    bucket becomes one ``update_weights`` per live engine, and before the stream writes into a slot again every
    engine has loaded what it held before."""

    def __init__(self, conn: Connection, engines: list[int], slot_bytes: int, gloo: bool):
        self.conn, self.live, self.gloo = conn, list(engines), gloo
        self.slot_bytes = slot_bytes
        if gloo:
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(2)]
        else:           # the file's slots may be larger than this push's (an earlier push's): the engines'
            stride = conn.slot_bytes        # slot k starts at k x the announced slot size
            self.buffers = [conn.shm[k * stride:k * stride + slot_bytes] for k in range(2)]
        self.slot, self.entries = None, []  # the bucket being filled: its slot, its tensors so far
        self.pending = [None, None]         # per slot: ({engine: future}, {engine: gloo work})
        self.sent = {i: 0 for i in engines}
        self.updates = 0

    def slot_for(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The stream's ``out``: the memory of bucket ``k`` (slot ``k % 2``, as ``dtype``). Bucket ``k`` is asked
        for once the stream has yielded every tensor of bucket ``k - 2``; it was sent then at the latest (see
        :meth:`add`), and is waited for here: the engines are done with the slot before the stream writes."""
        slot = k % 2
        if numel * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"push_weights: a bucket of {numel * dtype.itemsize} bytes does not fit the "
                             f"{self.slot_bytes}-byte slot")
        if self.slot == slot:               # the bucket in this slot is complete: the stream asks for it again
            self.flush()
        self.wait(slot)
        return self.buffers[slot][:numel * dtype.itemsize].view(dtype)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor the stream yielded: a view of one of the slots (the slot's bucket is sent when the first
        tensor of another slot arrives, or at :meth:`close`)."""
        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        slot = next((k for k, b in enumerate(self.buffers) if b.data_ptr() <= ptr
                     and ptr + nbytes <= b.data_ptr() + b.numel()), None)
        if slot is None or not tensor.is_contiguous():
            raise RuntimeError(f"push_weights: the stream yielded {name} outside the shared slots (it must write "
                               "into the memory push_weights hands it)")
        if self.slot is not None and slot != self.slot:
            self.flush()
        self.slot = slot
        self.entries.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                             ptr - self.buffers[slot].data_ptr()))

    def flush(self) -> None:
        """Send the bucket in the current slot to every live engine (without waiting for them)."""
        if not self.entries:
            return
        names, dtypes, shapes, offsets = (list(x) for x in zip(*self.entries))
        nbytes = max(o + torch.empty((), dtype=getattr(torch, d)).element_size() * _numel(s)
                     for o, d, s in zip(offsets, dtypes, shapes))
        info = {"transport": "gloo" if self.gloo else "shm", "names": names, "dtypes": dtypes, "shapes": shapes,
                "offsets": offsets, "nbytes": nbytes, "secret": self.conn.secret}
        if not self.gloo:
            info.update(slot=self.slot, path=self.conn.path)
        futures, works = {}, {}
        for i in self.live:
            futures[i] = self.conn.submit(i, self.conn.handles[i].update, info)
            if self.gloo:
                works[i] = self.conn.groups[i].broadcast(self.buffers[self.slot][:nbytes], 0)
            self.sent[i] += nbytes
        self.pending[self.slot] = (futures, works)
        self.updates += 1
        self.slot, self.entries = None, []

    def wait(self, slot: int) -> None:
        """Every engine has loaded ``slot`` (or is marked failed and dropped)."""
        if self.pending[slot] is None:
            return
        futures, works = self.pending[slot]
        self.pending[slot] = None
        failed = wait_all(futures, self.conn.timeout + 30, what="update_weights", names=self.conn.engines)
        for i, work in works.items():
            if i in failed:
                continue                    # its group is given up; the work ends with the group's timeout
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 - that engine's group failed
                failed[i] = f"update_weights: the gloo broadcast failed ({type(e).__name__}: {e})"
        for i, why in failed.items():
            self.conn.fail(i, why)
            if i in self.live:
                self.live.remove(i)

    def close(self) -> None:
        self.flush()
        self.wait(0)
        self.wait(1)

    def abandon(self) -> None:
        """After a trainer failure: the bucket being filled is not sent; the updates in flight end."""
        self.slot, self.entries = None, []
        self.wait(0)
        self.wait(1)


# Engines in other processes take the stream in larger buckets than the export stream's default (64 MiB): every
# bucket is one update_weights call per engine (an HTTP request, the engine core, its workers), and on the bench
# (bench/RESULTS.md, issue 37) 512 MiB buckets pushed a 2 GB model in 3.15 s against 5.09 s with 64 MiB. The
# sender's shared memory is two slots of a bucket (verl's rollout default is 2048 MiB:
# update_weights_bucket_megabytes).
REMOTE_BUCKET_BYTES = 512 << 20
SLOT_SLACK = 1 << 20        # room for the stream's per-tensor alignment inside a bucket that holds the whole model


def _largest_entry(chunks, layout, meta) -> int:
    """Bytes of the largest group of HF tensors the stream keeps in one bucket (a table entry: q / k / v, gate /
    up, a layer's experts): a bucket holds at most ``bucket_bytes`` of them, or one such entry larger than that,
    so a slot of ``max(bucket_bytes, this)`` takes any bucket."""
    sizes = {m.name: _numel(m.shape) * m.dtype.itemsize for m in meta}
    _, everything = model_entries(chunks, layout)
    return max((sum(sizes[n] for n in e.hf) for _, e in saved_entries(everything)), default=0)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _before(conn: Connection, meta, wire: torch.dtype, slot_bytes: int) -> list[int]:
    """On the sender: the transport, ``verify``, ``pause``, an interrupted update's ``finish`` and
    ``start_weight_update`` on every healthy engine; the engines that started (an engine failing a step is marked
    failed; a model that does not match raises)."""
    if conn.handles is None:
        raise ValueError("push_weights: this rank is not the connection's sender")
    if not conn.healthy():
        raise EngineFailed(f"push_weights: every engine needs a restart: {conn.needs_restart}")
    if conn.backend == "parallm_shm":
        conn.open_shm(slot_bytes)
    elif not conn.groups:
        conn.open_gloo()
    verify = {"names": [m.name for m in meta], "shapes": [list(m.shape) for m in meta],
              "dtype": str(wire).removeprefix("torch.")}
    unreachable = {}
    for i, why in conn.on_all(lambda h: h.init({"verify": verify}), what="verify").items():
        if "cannot be reached" in why or "did not answer" in why:
            unreachable[i] = why
        else:
            raise ValueError(f"push_weights: {conn.handles[i].name}: {why}")
    for i, why in unreachable.items():
        conn.fail(i, why)
    for i, why in conn.on_all(lambda h: h.pause(), what="pause").items():
        conn.fail(i, why)
    conn.paused = set(conn.healthy())            # what this push paused (and the interrupted ones, paused before)
    interrupted = [i for i in conn.healthy() if i in conn.interrupted]   # their update is still open: close it
    for i, why in conn.on_all(lambda h: h.finish(), interrupted, what="finish_weight_update (interrupted)").items():
        conn.fail(i, why)
    for i, why in conn.on_all(lambda h: h.start(), what="start_weight_update").items():
        conn.fail(i, why)
    _resume_failed(conn)
    return conn.healthy()


def _resume_failed(conn: Connection) -> None:
    """Resume every engine paused for this push that then failed: a paused ``vllm serve`` holds its callers'
    requests until resumed, so one left paused would hang them. It stays in ``needs_restart`` (vLLM takes no
    update after a failed one) and the push raises naming it: what it serves until restarted is its old weights
    when it failed before the stream, otherwise not to be trusted (a partial update makes vLLM's next generate
    fail; a refused prefix-cache reset leaves prefixes of the old weights cached). An interrupted engine (a
    trainer failure mid-stream, not its own) stays paused until the next push completes it."""
    failed = [i for i in sorted(getattr(conn, "paused", ())) if i in conn.failed]
    if failed:
        conn.on_all(lambda h: h.resume(), failed, what="resume (failed engine)")
        conn.paused -= set(failed)


def _reset_checked(handle) -> None:
    if not handle.reset_prefix_cache():
        raise EngineError(f"{handle.name}: vLLM refused to reset the prefix cache (blocks still in use: requests "
                          "ran during the push); cached prefixes would keep keys and values of the old weights")


def _after(conn: Connection, engines: list[int]) -> dict[int, float]:
    """``finish_weight_update``, a checked prefix-cache reset and ``resume`` on every engine of ``engines`` still
    live (each then holds this push in full: no longer interrupted); when each one finished
    (``time.perf_counter()``)."""
    live = [i for i in engines if i not in conn.failed]
    done = {}

    def finish(h):
        h.finish()
        done[conn.handles.index(h)] = time.perf_counter()
    for what, fn in (("finish_weight_update", finish), ("reset_prefix_cache", _reset_checked),
                     ("resume", lambda h: h.resume())):
        for i, why in conn.on_all(fn, [i for i in live if i not in conn.failed], what=what).items():
            conn.fail(i, why)
    for i in live:
        if i not in conn.failed:
            conn.interrupted.pop(i, None)
    return done


def _interrupted(conn: Connection, fanout: "_Fanout", engines: list[int], was: set, error) -> None:
    """After a trainer failure mid-stream: an engine that received part of this push (or held an interrupted one
    before it) is left unfinished and paused and marked interrupted; the others (nothing received: their old
    weights intact) are finished and resumed."""
    fanout.abandon()
    why = f"a trainer failure interrupted the push ({type(error).__name__}: {error})"
    clean = []
    for i in engines:
        if i in conn.failed:
            continue
        if fanout.sent[i] > 0 or i in was:
            conn.interrupt(i, f"{why} after {fanout.sent[i]} bytes: not finished, paused until a complete push")
        else:
            clean.append(i)
    _after(conn, clean)


def _send(conn: Connection, stream, state, fanout: _Fanout, engines: list[int], tried: list[int], was: set):
    """The sender's loop: every tensor of the stream into the fan-out, then the engines finished (or, after a
    trainer failure, :func:`_interrupted`). Returns (the error, when each engine finished, bytes, tensors)."""
    error, finished, nbytes, tensors = None, {}, 0, 0
    try:
        for name, tensor in stream:
            fanout.add(name, tensor)
            nbytes += tensor.numel() * tensor.element_size()
            tensors += 1
        fanout.close()
    except Exception as e:  # noqa: BLE001 - ends the stream on every rank, or is agreed on by the caller
        error = e
        if not state.exchanged:
            try:
                stream.throw(e)
            except BaseException:  # noqa: BLE001 - the stream re-raises what it was told
                pass
    if error is None:
        finished = _after(conn, engines)
        _resume_failed(conn)
        failed = [i for i in tried if i in conn.failed]
        if failed:
            error = EngineFailed("push_weights: engine(s) failed in this push and need a restart (vLLM takes no "
                                 "update after a failed one); the other engines received every tensor: "
                                 + conn.describe(failed))
    else:
        try:
            _interrupted(conn, fanout, engines, was, error)
            _resume_failed(conn)
        except Exception:  # noqa: BLE001 - the trainer's error is the one reported
            pass
    return error, finished, nbytes, tensors


def push_remote(chunks, conn: Connection, *, dtype: torch.dtype | None = None, bucket_bytes=None) -> dict:
    """See :func:`~parallm.integrations.vllm.push_weights` (its second form) and the module docstring."""
    t0 = time.perf_counter()
    chunks = as_chunks(chunks)
    require_loaded(chunks, "push_weights")     # before any engine is paused or told an update starts
    layout = dims_of(chunks)
    me, sender = layout.rank, conn.sender
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise ValueError(f"push_weights: dtype must be None or one of {[str(d) for d in WIRE_DTYPES]}, got {dtype}")
    wire = dtype or chunks[0].config.params_dtype
    bucket = _parse_bucket(bucket_bytes or REMOTE_BUCKET_BYTES)
    meta = export_metadata(chunks, dtype=wire)
    # a slot takes any bucket: the bucket size, or the model when smaller (plus the stream's alignment padding),
    # or one table entry larger than both
    total = sum(_numel(m.shape) * m.dtype.itemsize for m in meta)
    slot_bytes = _align(max(min(bucket, _align(total) + SLOT_SLACK), _largest_entry(chunks, layout, meta)))
    error, engines, tried, was = None, [], [], set()
    if me == sender:
        try:
            tried, was = conn.healthy(), set(conn.interrupted)
            engines = _before(conn, meta, wire, slot_bytes)
            if not engines:
                raise EngineFailed("push_weights: no engine could take the push; every engine needs a restart: "
                                   + conn.describe(tried))
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error = e
    statuses = gather_objects(status_of(error), what="push_weights", error=error)
    if any(s is not None for s in statuses):
        _raise(error, statuses, sender)
    fanout, finished = None, {}
    if me == sender:
        fanout = _Fanout(conn, engines, slot_bytes, conn.backend == "parallm_gloo")
    stream, state = open_stream(chunks, dtype=wire, bucket_bytes=bucket, dst_ranks=[sender], what="push_weights",
                                out=None if fanout is None else (lambda k, n: fanout.slot_for(k, n, wire)))
    nbytes = tensors = 0
    if me == sender:
        error, finished, nbytes, tensors = _send(conn, stream, state, fanout, engines, tried, was)
        if state.exchanged and error is not None:
            raise error
    else:
        try:
            for _ in stream:
                pass
        except Exception as e:  # noqa: BLE001 - the sender's failure (or another rank's), told by the stream
            if state.exchanged:
                raise
            error = e
    seconds = time.perf_counter() - t0
    summary = None
    if me == sender and error is None:
        summary = {"bytes": nbytes, "tensors": tensors, "updates": fanout.updates, "engines": {
            conn.handles[i].name: {"bytes": fanout.sent[i], "seconds": finished[i] - t0} for i in engines},
            "needs_restart": conn.needs_restart}
    gathered = gather_objects((status_of(error), seconds, summary), what="push_weights", error=error)
    statuses = [g[0] for g in gathered]
    if any(s is not None for s in statuses):
        _raise(error, statuses, sender)
    seconds = max(g[1] for g in gathered)
    out = dict(gathered[sender][2])
    out.update(seconds=seconds, gbps=out["bytes"] / seconds / 1e9 if seconds else 0.0, buckets=state.buckets)
    for stats in out["engines"].values():   # seconds: from the call to the engine's finish_weight_update
        stats["gbps"] = stats["bytes"] / stats["seconds"] / 1e9 if stats["seconds"] else 0.0
    return out


def _raise(error, statuses, sender: int) -> None:
    """The same error on every rank: this rank's own, else the first failure's (an engine's failure on the
    sender stays an :class:`EngineFailed` everywhere)."""
    if error is not None:
        raise error
    status = statuses[sender]
    if status is not None and status[0] == EngineFailed.__name__:
        raise EngineFailed(f"push_weights failed on rank {sender}: {status[1]}")
    raise_failures(statuses, what="push_weights")

