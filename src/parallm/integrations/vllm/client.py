"""The trainer's side of engines in other processes: :func:`connect` and the engines' control calls.

An engine is either the URL of a ``vllm serve`` server (``python -m vllm.entrypoints.openai.api_server ...``,
started with ``VLLM_SERVER_DEV_MODE=1`` for the weight-transfer routes and ``--weight-transfer-config
'{"backend": "parallm"}'``), or a ``vllm.LLM`` whose engine core and workers run in processes of their own
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default; ``weight_transfer_config={"backend": "parallm"}``). Each is
driven through vLLM's weight-transfer calls: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update`` (HTTP routes, or the ``LLM``'s methods of the same names).

:func:`connect` is collective over the trainer's world; one rank (``sender``, default 0) talks to the engines and
owns the transport; the other ranks only know who the sender is (they take part in the export stream). A
:class:`Connection` remembers which engines failed: vLLM cannot take another update after a failed one, so a
failed engine is reported (:class:`EngineFailed`, ``Connection.needs_restart``) and left out of later pushes until
it is restarted and connected again. The engines themselves are :mod:`.engines`; the transports' pieces (the
shared-memory file, the gloo rendezvous, the per-connection secret) :mod:`.transport`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import time
import uuid
import weakref

import torch
import torch.distributed as dist

from ...errors import ParallelError
from ...parallel.errors import exchange_rows, gather_objects, raise_failures, status_of
from .engines import EngineError, Lane, _HttpEngine, _LLMEngine
from .transport import create_shm_file, gloo_options, new_secret, sender_address, sender_store

__all__ = ["Connection", "EngineFailed", "connect"]

TIMEOUT_S = 300.0


class EngineFailed(ParallelError):
    """One or more engines failed during a weight transfer and need a restart (vLLM cannot take another update
    after a failed one); the message names them and why."""


class Connection:
    """Engines in other processes, connected to the trainer (:func:`connect`). On the sending rank it holds the
    engines (``engines``: their names), one daemon thread per engine for their calls (so an engine's calls keep
    their order and the engines run side by side), and the transport (a shared-memory file, or a gloo group per
    engine); on the other ranks only ``sender``, ``backend`` and the engines' count. ``close()`` releases the
    transport (the shared-memory file is removed; also when the connection is garbage-collected or the process
    exits).

    ``needs_restart`` (sender): the engines that must not be used, by name: those that failed (``failed``: killed,
    unreachable, an update or a control call that raised; vLLM takes no update after a failed one, so they are
    left out of later pushes until restarted and connected again) and those whose push a trainer failure
    interrupted (``interrupted``: they hold part of the new weights and are neither finished nor resumed; the
    next push goes to them too and, complete, makes them usable again). ``usable()``: the others."""

    def __init__(self, *, sender: int, backend: str, handles, timeout: float, master_address: str | None):
        self.sender, self.backend, self.timeout = sender, backend, timeout
        self.handles = handles                      # None off the sender
        self.count = len(handles) if handles is not None else 0
        self.failed: dict[int, str] = {}
        self.interrupted: dict[int, str] = {}
        self.paused: set[int] = set()               # engines the push in progress paused (remote.py)
        self.master_address = master_address
        self.workers = [h.workers() for h in handles] if handles else []
        self.lanes = [Lane(f"parallm-engine-{i}") for i in range(self.count)]
        self.secret = new_secret()
        self.slot_bytes = 0
        self.path = None
        self.shm = None                              # uint8 tensor over the file, two slots
        self.store = None
        self.groups: dict[int, object] = {}
        self.generation = 0

    @property
    def engines(self) -> list[str]:
        return [h.name for h in self.handles] if self.handles else []

    @property
    def needs_restart(self) -> list[str]:
        if not self.handles:
            return []
        return [self.handles[i].name for i in sorted({*self.failed, *self.interrupted})]

    def usable(self) -> list[int]:
        """The engines that hold the last complete push (neither failed nor interrupted)."""
        return [i for i in range(self.count) if i not in self.failed and i not in self.interrupted]

    def healthy(self) -> list[int]:
        """The engines a push goes to: the usable ones and the interrupted ones (not the failed)."""
        return [i for i in range(self.count) if i not in self.failed]

    def fail(self, i: int, why: str) -> None:
        self.interrupted.pop(i, None)
        self.failed.setdefault(i, why)

    def interrupt(self, i: int, why: str) -> None:
        if i not in self.failed:
            self.interrupted[i] = why

    def describe(self, engines) -> str:
        """``name: why`` of each engine in ``engines`` that failed or was interrupted."""
        why = {**self.interrupted, **self.failed}
        return "; ".join(f"{self.handles[i].name}: {why[i]}" for i in engines if i in why)

    def on_all(self, fn, engines=None, *, what: str) -> dict[int, str]:
        """``fn(handle)`` on each engine (default: the healthy ones) at once, each on its own thread; the
        failures, ``{engine: message}`` (nothing raised)."""
        engines = self.healthy() if engines is None else engines
        futures = {i: self.lanes[i].submit(fn, self.handles[i]) for i in engines}
        return wait_all(futures, self.timeout + 30, what=what, names=self.engines)

    def submit(self, i: int, fn, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on engine ``i``'s thread, after its calls already queued."""
        return self.lanes[i].submit(fn, *args)

    def checksums(self) -> dict[str, dict[str, str]]:
        """On the sender: each usable engine's digests of its parameters (vLLM's ``/weight_checker`` checksum,
        or ``compute_weight_checksums`` of an ``LLM``'s workers), ``{engine: {worker prefix + vLLM parameter name:
        digest}}``. Taken before and after a push, the names whose digest changed are the tensors the push
        reached in the engine. vLLM's names and shards, not the HF ones (fused qkv / gate_up, a worker's rows).
        On vLLM-CPU the linear layers run from prepacked copies the digests do not see (their parameters keep the
        first load's values, or placeholders): only the other tensors (embeddings, norms, biases, MoE experts)
        show a push there; the log-prob comparison sees everything. Not collective."""
        if self.handles is None:
            raise ValueError("checksums: this rank is not the connection's sender")
        futures = {i: self.submit(i, self.handles[i].checksums) for i in self.usable()}
        return {self.handles[i].name: f.result(timeout=self.timeout) for i, f in futures.items()}

    # -- the transport (sender) ------------------------------------------------------------------------------
    def open_shm(self, slot_bytes: int) -> None:
        """A shared-memory file of two slots of ``slot_bytes`` (:func:`.transport.create_shm_file`: mode 0600,
        allocated at once, an ``OSError`` when the directory has no room), announced to every healthy engine
        (again when a push needs larger slots)."""
        if self.shm is not None and self.slot_bytes >= slot_bytes:
            return
        self._drop_shm()
        self.path = create_shm_file(2 * slot_bytes, tag=f"{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self._unlink = weakref.finalize(self, _unlink, self.path)     # also at exit, when close() is not called
        self.shm = torch.from_file(self.path, shared=True, size=2 * slot_bytes, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        info = {"transport": "shm", "path": self.path, "slot_bytes": slot_bytes, "slots": 2, "secret": self.secret}
        for i, why in self.on_all(lambda h: h.init(info), what="init_weight_transfer_engine").items():
            self.fail(i, why)

    def open_gloo(self) -> None:
        """A gloo group per healthy engine: the sender at rank 0, the engine's workers after it. The sender's
        store listens on the address the engines reach it at (:func:`.transport.sender_address`, or
        ``master_address``); the groups' keys lie under the connection's secret. Every engine's init runs on its
        own thread while the sender joins that engine's group on another, all at once: an engine whose init
        fails is given up at once, and a dead engine does not make the others wait (or time out)."""
        self.close_transport()
        self.generation += 1
        address = self.master_address or sender_address([(h.host, h.port) for h in self.handles if not h.local()])
        self.store = store = sender_store(address, self.timeout)
        root = f"parallm/{self.secret}"
        store.set(f"{root}/auth", "parallm")
        inits, joins = {}, {}
        for i in self.healthy():
            group, size = f"{root}/{self.generation}/{i}", 1 + self.workers[i]
            info = {"transport": "gloo", "master_address": address, "master_port": store.port, "rank_offset": 1,
                    "world_size": size, "group": group, "timeout_s": self.timeout, "secret": self.secret}
            inits[i] = self.submit(i, self.handles[i].init, info)
            joiner = Lane(f"parallm-gloo-join-{i}")
            joins[i] = joiner.submit(self._join, address, store.port, group, size)
            joiner.shutdown()
        for i, why in _joined(inits, joins, self.timeout + 30, self.groups).items():
            self.fail(i, why)

    def _join(self, address: str, port: int, group: str, size: int):
        """The sender's side of one engine's group, through a store connection of its own (a ``TCPStore``'s
        calls are serialised: a join waiting on a dead engine's keys would hold up every other join)."""
        store = dist.TCPStore(address, port, is_master=False,
                              timeout=datetime.timedelta(seconds=self.timeout))
        return dist.ProcessGroupGloo(dist.PrefixStore(group, store), 0, size, gloo_options(address, self.timeout))

    def _drop_shm(self) -> None:
        self.shm = None
        if self.path is not None:
            self._unlink()
            self.path = None

    def close_transport(self) -> None:
        self._drop_shm()
        self.groups.clear()
        self.store = None

    def close(self) -> None:
        """Release the transport; the engines keep running (connect to them again to push)."""
        self.close_transport()
        for lane in self.lanes:
            lane.shutdown()
        self.lanes = []

    def __repr__(self) -> str:
        return (f"Connection(backend={self.backend!r}, sender={self.sender}, engines={self.engines or self.count}, "
                f"needs_restart={self.needs_restart})")


def _joined(inits: dict, joins: dict, timeout: float, groups: dict) -> dict[int, str]:
    """Wait for every engine's init and the sender's side of its group (``{engine: future}`` each); the groups
    made go into ``groups``; ``{engine: why}`` for the others. An engine is decided as soon as either of its
    futures fails (its other one is left to end by its own timeout), or when both are done."""
    deadline = time.monotonic() + timeout
    failed, pending = {}, set(inits)
    while pending:
        for i in list(pending):
            for what, fut in (("init_weight_transfer_engine", inits[i]), ("the sender's gloo group", joins[i])):
                if fut.done() and fut.exception() is not None:
                    e = fut.exception()
                    failed[i] = f"{what}: {e}" if isinstance(e, EngineError) else f"{what}: {type(e).__name__}: {e}"
                    break
            if i in failed:
                pending.discard(i)
            elif inits[i].done() and joins[i].done():
                groups[i] = joins[i].result()
                pending.discard(i)
        left = deadline - time.monotonic()
        if not pending:
            break
        if left <= 0:
            for i in pending:
                failed[i] = f"init_weight_transfer_engine did not answer within {timeout:.0f} s"
            break
        concurrent.futures.wait([f for i in pending for f in (inits[i], joins[i]) if not f.done()], timeout=left,
                                return_when=concurrent.futures.FIRST_COMPLETED)
    return failed


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def wait_all(futures: dict, timeout: float, *, what: str, names) -> dict[int, str]:
    """Wait for ``{engine: future}``; ``{engine: why}`` for those that raised or did not answer in time."""
    out = {}
    deadline = time.monotonic() + timeout
    for i, fut in futures.items():
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            out[i] = f"{what} did not answer within {timeout:.0f} s"
        except Exception as e:  # noqa: BLE001 - reported per engine
            out[i] = f"{what}: {e}" if isinstance(e, EngineError) else f"{what}: {type(e).__name__}: {e}"
    return out


def _handles(engines, timeout: float) -> list:
    if isinstance(engines, (str, bytes)) or not isinstance(engines, (list, tuple)):
        engines = [engines]
    out = []
    for i, e in enumerate(engines):
        if isinstance(e, str):
            out.append(_HttpEngine(e, timeout))
        elif hasattr(e, "llm_engine") and hasattr(e, "init_weight_transfer_engine"):
            out.append(_LLMEngine(e, i))
        else:
            raise TypeError(f"connect: engine #{i} is a {type(e).__name__}; engines are URLs of vllm serve "
                            "servers or vllm.LLM objects")
    if not out:
        raise ValueError("connect: no engines given")
    return out


def connect(engines, *, backend: str = "parallm_shm", sender: int = 0, timeout: float = TIMEOUT_S,
            master_address: str | None = None) -> Connection:
    """Connect the trainer to engines in other processes. Collective over the trainer's world (every rank calls
    it with the same arguments; ``engines`` matters on ``sender`` only).

    ``engines``: one or several, each the URL of a ``vllm serve`` server (``"http://host:port"``) or a
    ``vllm.LLM`` with its own engine-core process; every engine must run one of parallm's weight-transfer
    backends (``weight_transfer_config={"backend": "parallm"}``, or the one named here). ``backend``:
    ``"parallm_shm"`` (engines on this host; one shared-memory file) or ``"parallm_gloo"`` (any host; a gloo
    group per engine, so that a dead engine fails only its own group: see :mod:`.backends`; rendezvous at
    ``master_address``, the only address the sender's store listens on: default 127.0.0.1 when every engine is
    local, else this host's address on the interface that routes to the engines, an error when that is a
    loopback address or differs between engines). ``timeout``: seconds any one engine call or gloo collective may
    take before the engine is declared failed. Errors (an unknown backend, an engine that cannot be reached or
    runs another backend) raise on every rank.

    Pushes go through :func:`~parallm.integrations.vllm.push_weights` ``(chunks, connection)``.
    """
    world, me = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    error, conn = None, None
    try:
        if backend not in ("parallm_shm", "parallm_gloo"):
            raise ValueError(f"connect: unknown backend {backend!r}; parallm's are 'parallm_shm' (same host) and "
                             "'parallm_gloo' (any host). vLLM's own (nccl, ipc) take a WeightSource: "
                             "parallm.integrations.vllm.source.ExportSource")
        if not (isinstance(sender, int) and 0 <= sender < world):
            raise ValueError(f"connect: sender must be a global rank of the world of {world}, got {sender!r}")
        if me == sender:
            handles = _handles(engines, timeout)
            conn = Connection(sender=sender, backend=backend, handles=handles, timeout=timeout,
                              master_address=master_address)
            if backend == "parallm_shm":
                remote = [h.name for h in handles if not h.local()]
                if remote:
                    raise ValueError(f"connect: parallm_shm reaches engines on this host only; {remote} are not: "
                                     "use backend='parallm_gloo'")
            else:
                conn.open_gloo()
            if conn.failed:
                raise EngineError("; ".join(f"{conn.handles[i].name}: {w}" for i, w in conn.failed.items()))
    except Exception as e:  # noqa: BLE001 - raised on every rank
        error = e
        if conn is not None:
            conn.close()
    if world > 1:
        rows = exchange_rows([int(error is not None), conn.count if conn is not None else 0], what="connect",
                             error=error)
        if rows[:, 0].any():
            statuses = gather_objects(status_of(error), what="connect", error=error)
            if error is not None:
                raise error
            raise_failures(statuses, what="connect")
        count = int(rows[sender, 1])
    elif error is not None:
        raise error
    else:
        count = conn.count
    if conn is None:
        conn = Connection(sender=sender, backend=backend, handles=None, timeout=timeout, master_address=None)
        conn.count = count
    return conn
