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
it is restarted and connected again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import socket
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref

import torch
import torch.distributed as dist

from ...errors import ParallelError
from ...parallel.errors import exchange_rows, gather_objects, raise_failures, status_of

__all__ = ["Connection", "EngineFailed", "connect"]

TIMEOUT_S = 300.0


class EngineFailed(ParallelError):
    """One or more engines failed during a weight transfer and need a restart (vLLM cannot take another update
    after a failed one); the message names them and why."""


class EngineError(RuntimeError):
    """An engine's control call failed (the engine's own message, or why it could not be reached)."""


class _HttpEngine:
    """A ``vllm serve`` server, through its weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout = timeout
        self.host = urllib.parse.urlparse(self.url).hostname or "127.0.0.1"

    def _request(self, path: str, body=None, *, method: str = "POST"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as res:
                text = res.read().decode() or "null"
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            with contextlib.suppress(Exception):
                parsed = json.loads(detail)
                detail = (parsed.get("error") or {}).get("message") or parsed.get("detail") or detail
            if e.code == 404:
                detail += (" (the weight-transfer routes exist only when the server runs with "
                           "VLLM_SERVER_DEV_MODE=1)")
            raise EngineError(f"{self.name}/{path}: HTTP {e.code}: {detail}") from None
        except (OSError, urllib.error.URLError) as e:
            raise EngineError(f"{self.name}/{path}: the engine cannot be reached ({e})") from None
        return json.loads(text)

    def workers(self) -> int:
        return int(self._request("get_world_size?include_dp=true", method="GET")["world_size"])

    def init(self, info: dict) -> None:
        self._request("init_weight_transfer_engine", {"init_info": info})

    def start(self) -> None:
        self._request("start_weight_update")

    def update(self, info: dict) -> None:
        self._request("update_weights", {"update_info": info})

    def finish(self) -> None:
        self._request("finish_weight_update")

    def reset_prefix_cache(self) -> None:
        self._request("reset_prefix_cache")

    def checksums(self) -> dict[str, str]:
        return self._request("weight_checker", {"action": "checksum"})["checksums"]

    def local(self) -> bool:
        return self.host in ("localhost", "127.0.0.1", "::1", socket.gethostname())


class _LLMEngine:
    """A ``vllm.LLM`` of this process whose engine core and workers run in processes of their own."""

    def __init__(self, llm, index: int):
        self.llm = llm
        self.name = f"LLM #{index}"
        engine = llm.llm_engine
        if getattr(engine, "model_executor", None) is not None:
            raise ValueError(f"connect: {self.name} runs its engine core in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0); its workers would be this process: push to it "
                             "with push_weights(chunks, llm, rank=...) (the in-process path), or start it with "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=1")
        config = engine.vllm_config
        if config.weight_transfer_config is None:
            raise ValueError(f"connect: {self.name} was started without weight_transfer_config: pass "
                             "weight_transfer_config={'backend': 'parallm'} to vllm.LLM")
        self.host = "127.0.0.1"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - named and handed on
            raise EngineError(f"{self.name}: {type(e).__name__}: {e}") from None

    def workers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp)

    def init(self, info: dict) -> None:
        self._call(self.llm.init_weight_transfer_engine, {"init_info": info})

    def start(self) -> None:
        self._call(self.llm.start_weight_update)

    def update(self, info: dict) -> None:
        self._call(self.llm.update_weights, {"update_info": info})

    def finish(self) -> None:
        self._call(self.llm.finish_weight_update)

    def reset_prefix_cache(self) -> None:
        self._call(self.llm.reset_prefix_cache)

    def checksums(self) -> dict[str, str]:
        out = {}
        for part in self._call(self.llm.collective_rpc, "compute_weight_checksums"):
            out.update(part)
        return out

    def local(self) -> bool:
        return True


class Connection:
    """Engines in other processes, connected to the trainer (:func:`connect`). On the sending rank it holds the
    engines (``engines``: their names), one thread per engine for their calls (so an engine's calls keep their
    order and the engines run side by side), and the transport (a shared-memory file, or a gloo group per
    engine); on the other ranks only ``sender``, ``backend`` and the engines' count. ``needs_restart``: the
    engines that failed (left out of later pushes). ``close()`` releases the transport (the shared-memory file is
    removed; also when the connection is garbage-collected or the process exits)."""

    def __init__(self, *, sender: int, backend: str, handles, timeout: float, master_address: str | None):
        self.sender, self.backend, self.timeout = sender, backend, timeout
        self.handles = handles                      # None off the sender
        self.count = len(handles) if handles is not None else 0
        self.failed: dict[int, str] = {}
        self.master_address = master_address
        self.workers = [h.workers() for h in handles] if handles else []
        self.pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"parallm-engine-{i}")
                      for i in range(self.count)]
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
        return [self.handles[i].name for i in sorted(self.failed)] if self.handles else []

    def healthy(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.failed]

    def fail(self, i: int, why: str) -> None:
        self.failed.setdefault(i, why)

    def on_all(self, fn, engines=None, *, what: str) -> dict[int, str]:
        """``fn(handle)`` on each engine (default: the healthy ones) at once, each on its own thread; the
        failures, ``{engine: message}`` (nothing raised)."""
        engines = self.healthy() if engines is None else engines
        futures = {i: self.pools[i].submit(fn, self.handles[i]) for i in engines}
        return wait_all(futures, self.timeout + 30, what=what, names=self.engines)

    def checksums(self) -> dict[str, dict[str, str]]:
        """On the sender: each healthy engine's digests of its parameters (vLLM's ``/weight_checker`` checksum,
        or ``compute_weight_checksums`` of an ``LLM``'s workers), ``{engine: {worker prefix + vLLM parameter name:
        digest}}``. Taken before and after a push, the names whose digest changed are the tensors the push
        reached in the engine. vLLM's names and shards, not the HF ones (fused qkv / gate_up, a worker's rows).
        On vLLM-CPU the linear layers run from prepacked copies the digests do not see (their parameters keep the
        first load's values, or placeholders): only the other tensors (embeddings, norms, biases, MoE experts)
        show a push there; the log-prob comparison sees everything. Not collective."""
        if self.handles is None:
            raise ValueError("checksums: this rank is not the connection's sender")
        futures = {i: self.pools[i].submit(self.handles[i].checksums) for i in self.healthy()}
        return {self.handles[i].name: f.result(timeout=self.timeout) for i, f in futures.items()}

    # -- the transport (sender) ------------------------------------------------------------------------------
    def open_shm(self, slot_bytes: int) -> None:
        """A shared-memory file of two slots of ``slot_bytes``, announced to every healthy engine (again when
        a push needs larger slots)."""
        if self.shm is not None and self.slot_bytes >= slot_bytes:
            return
        self._drop_shm()
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(directory, f"parallm_wt_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        with open(self.path, "wb") as f:
            f.truncate(2 * slot_bytes)
        self.shm = torch.from_file(self.path, shared=True, size=2 * slot_bytes, dtype=torch.uint8)
        self._unlink = weakref.finalize(self, _unlink, self.path)     # also at exit, when close() is not called
        self.slot_bytes = slot_bytes
        info = {"transport": "shm", "path": self.path, "slot_bytes": slot_bytes, "slots": 2}
        for i, why in self.on_all(lambda h: h.init(info), what="init_weight_transfer_engine").items():
            self.fail(i, why)

    def open_gloo(self) -> None:
        """A gloo group per healthy engine: the sender at rank 0, the engine's workers after it; every engine's
        init runs on its own thread while the sender joins each group."""
        self.close_transport()
        self.generation += 1
        timeout = datetime.timedelta(seconds=self.timeout)
        address = self.master_address or _address(self.handles)
        self.store = dist.TCPStore(address, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        futures = {}
        for i in self.healthy():
            info = {"transport": "gloo", "master_address": address, "master_port": self.store.port,
                    "rank_offset": 1, "world_size": 1 + self.workers[i], "group": f"parallm/{self.generation}/{i}",
                    "timeout_s": self.timeout}
            futures[i] = self.pools[i].submit(self.handles[i].init, info)
        errors = {}
        for i in list(futures):
            try:
                prefix = dist.PrefixStore(f"parallm/{self.generation}/{i}", self.store)
                self.groups[i] = dist.ProcessGroupGloo(prefix, 0, 1 + self.workers[i], timeout)
            except Exception as e:  # noqa: BLE001 - that engine failed
                errors[i] = f"{type(e).__name__}: {e}"
        for i, why in {**wait_all(futures, self.timeout + 30, what="init_weight_transfer_engine",
                                  names=self.engines), **errors}.items():
            self.fail(i, why)
            self.groups.pop(i, None)

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
        for pool in self.pools:
            pool.shutdown(wait=False)
        self.pools = []

    def __repr__(self) -> str:
        return (f"Connection(backend={self.backend!r}, sender={self.sender}, engines={self.engines or self.count}, "
                f"needs_restart={self.needs_restart})")


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


def _address(handles) -> str:
    if all(h.local() for h in handles):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


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
    ``master_address``: default 127.0.0.1 when every engine is local, else this host's address). ``timeout``:
    seconds any one engine call or gloo collective may take before the engine is declared failed. Errors (an
    unknown backend, an engine that cannot be reached or runs another backend) raise on every rank.

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
