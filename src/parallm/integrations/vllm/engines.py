"""The engines a :class:`~parallm.integrations.vllm.client.Connection` drives, and the threads that drive them.

An engine is either the URL of a ``vllm serve`` server (:class:`_HttpEngine`: vLLM's weight-transfer routes, which
exist only with ``VLLM_SERVER_DEV_MODE=1``) or a ``vllm.LLM`` whose engine core and workers run in processes of
their own (:class:`_LLMEngine`). Both offer the same calls: ``init`` / ``start`` / ``update`` / ``finish`` (vLLM's
weight-transfer calls), ``pause`` / ``resume`` (a server's generation drained and held around a push; an ``LLM``
generates only inside its caller's ``generate``, so there they do nothing), ``reset_prefix_cache`` (whether vLLM
reset it: it refuses while blocks are in use), ``checksums``, ``workers``, ``local``.

Each engine's calls run in order on a :class:`Lane`, a daemon thread of its own: a call that never returns (an
``LLM``'s ``collective_rpc`` has no timeout) is given up by the caller after the connection's timeout and cannot
keep the trainer's process from exiting (``concurrent.futures.ThreadPoolExecutor`` joins its threads at
interpreter exit).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import queue
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["EngineError", "Lane"]


class EngineError(RuntimeError):
    """An engine's control call failed (the engine's own message, or why it could not be reached)."""


class Lane:
    """One daemon thread running the calls submitted to it in order; ``submit`` returns a
    ``concurrent.futures.Future``. ``shutdown()`` lets the thread end after the calls already queued."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)
            item = future = fn = args = None

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.calls.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        self.calls.put(None)


class _HttpEngine:
    """A ``vllm serve`` server, through its weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.name = self.url
        self.timeout = timeout
        parsed = urllib.parse.urlparse(self.url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)

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

    def pause(self) -> None:
        """vLLM's ``/pause?mode=wait``: the requests in flight run to their end, new ones wait (queued) until
        :meth:`resume`; returns once the engine is idle."""
        self._request("pause?mode=wait&clear_cache=false")

    def resume(self) -> None:
        self._request("resume")

    def start(self) -> None:
        self._request("start_weight_update")

    def update(self, info: dict) -> None:
        self._request("update_weights", {"update_info": info})

    def finish(self) -> None:
        self._request("finish_weight_update")

    def reset_prefix_cache(self) -> bool:
        res = self._request("reset_prefix_cache")
        return bool(res.get("success", False)) if isinstance(res, dict) else False

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
        self.host, self.port = "127.0.0.1", 0

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - named and handed on
            raise EngineError(f"{self.name}: {type(e).__name__}: {e}") from None

    def workers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp)

    def init(self, info: dict) -> None:
        self._call(self.llm.init_weight_transfer_engine, {"init_info": info})

    def pause(self) -> None:
        """Nothing: an ``LLM`` generates only inside its caller's ``generate`` (not during a push, which is the
        same caller's); a ``generate`` on another thread meanwhile makes :meth:`reset_prefix_cache` refuse."""

    def resume(self) -> None:
        """Nothing (see :meth:`pause`)."""

    def start(self) -> None:
        self._call(self.llm.start_weight_update)

    def update(self, info: dict) -> None:
        self._call(self.llm.update_weights, {"update_info": info})

    def finish(self) -> None:
        self._call(self.llm.finish_weight_update)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call(self.llm.reset_prefix_cache))

    def checksums(self) -> dict[str, str]:
        out = {}
        for part in self._call(self.llm.collective_rpc, "compute_weight_checksums"):
            out.update(part)
        return out

    def local(self) -> bool:
        return True
