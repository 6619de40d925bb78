"""The Tinker server's HTTP layer on aiohttp (rank 0): what a request means is :mod:`.frontend`'s; this module
carries it.

- One event loop in a thread of its own (``tinker-http``; the leader's main thread runs
  :meth:`.dispatch.Leader.run`), aiohttp's low-level server (``aiohttp.web.Server``) with HTTP/1.1 keep-alive
  (the SDK's httpx pool reuses its connections) and ``TCP_NODELAY`` (aiohttp sets it on every connection, and
  writes a response's headers and a small body in one send: no delayed-ACK stall, issue 47).
- The headers are checked on the loop (:func:`.frontend.check_request`: version, route, key, size; pure, no
  lock) before a byte of the body is read; a refused request is answered and its connection closed at once
  (``lingering_time=0``: aiohttp does not drain an unread body); ``Expect: 100-continue`` is answered only once
  the checks passed. aiohttp's own parse errors (a malformed ``Content-Length``, a bad request line) get the
  SDK's JSON error body too (:class:`_Protocol`). Request bodies reach the routes as sent
  (``auto_decompress=False``: a zstd body is the forward_backward route's to expand, under its own cap).
- Route handlers are synchronous Python that may block briefly (the service's lock, the dispatcher's queue, a
  checkpoint archive built in memory): they run on a pool of :data:`ROUTE_THREADS` threads
  (``run_in_executor``), never on the loop.
- A streamed answer (a checkpoint archive): the route returns a callable that writes the body; it runs on the
  pool and its writes reach the loop through a queue of at most :data:`STREAM_QUEUE` chunks of
  :data:`STREAM_CHUNK` bytes, which the loop sends as HTTP/1.1 chunks while the client reads: a few MiB held
  whatever the archive's size. A client that stops reading for :data:`STREAM_STALL_S` or goes away ends the
  writer (its next write raises) and the connection; a writer that fails after the headers were sent closes
  the connection without the final chunk, so the client sees a truncated body, never a complete-looking one.
- ``retrieve_future`` is the exception: its long poll is an asyncio wait on the loop, with no thread parked per
  poll. :meth:`.futures.FutureStore.watch` calls back from the thread that completes the future (the
  dispatcher's, a sampler's), which wakes the poll with ``loop.call_soon_threadsafe``; a poll still pending
  after :data:`.futures.LONG_POLL_S` answers ``try_again`` (as before). Once the future is done (or unknown) the
  route itself answers on the loop: it does not wait then, only reads the store.
- :meth:`HttpServer.shutdown` wakes every poll in flight (they answer ``try_again``), gives routes still running
  :data:`SHUTDOWN_S` to answer (then closes their connections unanswered; their threads finish on their own),
  closes the listening socket and the connections, stops the loop and joins its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from http import HTTPStatus

from aiohttp import web

from .frontend import JSON, check_request, run_route
from .futures import LONG_POLL_S
from .protocol import DEFAULT_MAX_BODY, ApiError

__all__ = ["HttpServer", "ROUTE_THREADS", "start_http"]

log = logging.getLogger("parallm.tinker")
ROUTE_THREADS = 16         # route handlers at once (each brief); long polls take none
SHUTDOWN_S = 2.0           # how long shutdown waits for routes still running
STREAM_CHUNK = 1 << 20     # bytes a streamed answer sends at once
STREAM_QUEUE = 4           # chunks a streamed answer holds between its writer and the socket
STREAM_STALL_S = 60.0      # how long a streamed answer's writer waits for the client to read


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, its error responses in the SDK's JSON error body (``{"error", "category"}``)
    instead of plain text; called for requests aiohttp itself could not parse."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:          # as aiohttp: a response was half sent, the connection is lost
            raise ConnectionError("the response was sent already: no error response can follow")
        text = message or (f"{type(exc).__name__}: {exc}" if exc is not None else HTTPStatus(status).phrase)
        text = text.strip().splitlines()[0].rstrip(":") if text.strip() else HTTPStatus(status).phrase  # no caret
        log.warning("HTTP %d before routing (%s): %s", status, request.remote, text)
        body = {"error": f"bad request: {text}" if status < 500 else f"server error: {text}",
                "category": "user" if status < 500 else "server"}
        return _response(status, json.dumps(body).encode(), JSON, close=True)


class _Server(web.Server):
    def __call__(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, **self._kwargs)


def _response(status: int, data: bytes, content_type: str, *, close: bool = False) -> web.Response:
    resp = web.Response(status=status, body=data, content_type=content_type)
    if close:
        resp.force_close()
    return resp


class HttpServer:
    """The Tinker REST API on ``host:port`` from its own thread; ``server_address`` once listening (``port`` 0
    picks a free one); :meth:`shutdown` stops it."""

    def __init__(self, service, *, host: str, port: int, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
                 route_threads: int = ROUTE_THREADS):
        self.service, self.api_key, self.max_body = service, api_key, max_body
        self._host, self._port = host, port
        self._pool = concurrent.futures.ThreadPoolExecutor(route_threads, thread_name_prefix="tinker-route")
        self._polls: set[asyncio.Future] = set()           # long polls held
        self._routes: set[asyncio.Future] = set()          # routes running on the pool
        self._loop = asyncio.new_event_loop()
        self._runner = None
        self._stopped = False
        started = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(started,), name="tinker-http", daemon=True)
        self._thread.start()
        self.server_address = started.result(timeout=120)       # an OSError (port taken) is raised here

    # -- the loop's thread ------------------------------------------------------------------------------------
    def _main(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            address = self._loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            started.set_exception(e)
            self._loop.close()
            return
        started.set_result(address)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _start(self):
        server = _Server(self._handle, handler_cancellation=True, lingering_time=0, auto_decompress=False,
                         access_log=None)
        self._runner = web.ServerRunner(server, shutdown_timeout=SHUTDOWN_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        return tuple(self._runner.addresses[0][:2])

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        method, path = request.method, request.raw_path.split("?", 1)[0]      # as sent: no ".." resolved
        try:
            name, match, length = check_request(method, path, request.headers, api_key=self.api_key,
                                                max_body=self.max_body)
        except ApiError as e:                        # the body is still in the socket: this connection is done
            return _response(e.status, json.dumps(e.body()).encode(), JSON, close=True)
        if length and request.version == (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")     # curl's large bodies: sent only
            request.writer.output_size = 0                                     # once the checks passed
        try:
            raw = await request.content.readexactly(length) if length else b""
        except asyncio.IncompleteReadError as e:
            err = ApiError(400, f"the body ended after {len(e.partial)} of {length} bytes")
            return _response(400, json.dumps(err.body()).encode(), JSON, close=True)
        if name == "route_retrieve_future":
            waiting = await self._long_poll(raw)
            if waiting is not None:
                return _response(200, json.dumps(waiting).encode(), JSON)
            status, data, content_type = run_route(self.service, name, match, raw, request.headers, path)
        else:
            running = self._loop.run_in_executor(self._pool, run_route, self.service, name, match, raw,
                                                 request.headers, path)
            self._routes.add(running)
            try:
                status, data, content_type = await running
            finally:
                self._routes.discard(running)
        if callable(data):
            return await self._stream(request, data, content_type)
        return _response(status, data, content_type)

    async def _stream(self, request: web.BaseRequest, produce, content_type: str) -> web.StreamResponse:
        """Send what ``produce(file)`` writes, as it writes it (see the module's docstring)."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": content_type})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE)
        sink = _Sink(queue, self._loop, request.transport)
        writing = self._loop.run_in_executor(self._pool, sink.run, produce)
        self._routes.add(writing)
        broken, getter = False, None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, writing}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():                   # the writer returned: send what it left, then end
                    getter.cancel()
                    if queue.empty():
                        break
                    continue
                if sink.aborted:
                    continue
                try:
                    await resp.write(getter.result())
                except (ConnectionError, RuntimeError) as e:       # the client went away
                    log.warning("streamed answer to %s abandoned: %s", request.remote, e)
                    sink.aborted = broken = True                    # the writer's next write raises
            error = writing.result()
        finally:                                        # also when aiohttp cancels us (the client left)
            sink.aborted = True
            if getter is not None and not getter.done():
                getter.cancel()
            while not queue.empty():                    # a writer waiting on a full queue goes on (and stops)
                queue.get_nowait()
            self._routes.discard(writing)
        if error is not None or broken:
            if error is not None:
                log.error("streamed answer to %s failed after its headers: %s", request.remote, error)
            resp.force_close()
            if request.transport is not None:
                request.transport.abort()              # no final chunk: the client sees a truncated body
            return resp
        await resp.write_eof()
        return resp

    async def _long_poll(self, raw: bytes) -> dict | None:
        """Wait (on the loop) until the future the body names is done, at most :data:`LONG_POLL_S`: the SDK's
        ``try_again`` body if it is still pending then (or the server is stopping), None when the route can
        answer without waiting (done, unknown, or a body the route refuses)."""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return None
        rid = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return None
        store, loop = self.service.futures, self._loop
        waiter = loop.create_future()

        def wake():                                    # from the thread that completed the future
            try:
                loop.call_soon_threadsafe(_settle, waiter)
            except RuntimeError:                       # the loop is closed: the server stopped
                pass
        if not self._stopped and store.watch(rid, wake):
            self._polls.add(waiter)
            try:
                await asyncio.wait([waiter], timeout=LONG_POLL_S)
            finally:
                self._polls.discard(waiter)
                store.unwatch(rid, wake)
        entry = store.get(rid)                         # pending here: try_again (the route would wait)
        if entry is None or entry.done:
            return None
        return {"type": "try_again", "request_id": rid, "queue_state": "active"}

    async def _stop(self) -> None:
        self._stopped = True
        for waiter in list(self._polls):
            _settle(waiter)
        if self._routes:                   # a route's thread cannot be stopped: its answer is given up on
            await asyncio.wait(list(self._routes), timeout=SHUTDOWN_S)
            for running in list(self._routes):
                running.cancel()
        await self._runner.cleanup()

    # -- any thread --------------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving: polls in flight answer ``try_again``, connections close, the loop's thread ends (within
        about :data:`SHUTDOWN_S` when a route is still running, else at once). Idempotent."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout)
        except Exception:  # noqa: BLE001 - stop the loop whatever happened
            log.exception("stopping the HTTP server")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Sink:
    """The file a streamed answer's writer writes to (on a pool thread): whole chunks go to the loop's queue,
    waiting while it is full, at most :data:`STREAM_STALL_S` (then the connection is aborted). ``run`` returns
    the writer's exception, or None."""

    def __init__(self, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, transport):
        self.queue, self.loop, self.transport = queue, loop, transport
        self.buf, self.aborted, self.stalled = bytearray(), False, False

    def write(self, data) -> int:
        if self.aborted:
            raise ConnectionError("the client stopped reading the streamed answer")
        self.buf += data
        if len(self.buf) >= STREAM_CHUNK:
            self._put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def flush(self) -> None:
        pass

    def _put(self, chunk: bytes) -> None:
        put = asyncio.run_coroutine_threadsafe(self.queue.put(chunk), self.loop)
        try:
            put.result(STREAM_STALL_S)
        except concurrent.futures.TimeoutError:
            put.cancel()
            self.aborted = self.stalled = True
            if self.transport is not None:            # the loop's side may be stuck in a write: unblock it
                self.loop.call_soon_threadsafe(self.transport.abort)
            raise ConnectionError(f"the client read nothing of the streamed answer for {STREAM_STALL_S:.0f} s")
        if self.aborted:
            raise ConnectionError("the client stopped reading the streamed answer")

    def run(self, produce) -> BaseException | None:
        try:
            produce(self)
            if self.buf:
                self._put(bytes(self.buf))
        except BaseException as e:  # noqa: BLE001 - reported by the loop's side
            return e
        return None


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def start_http(service, *, host: str, port: int, api_key: str | None,
               max_body: int = DEFAULT_MAX_BODY) -> HttpServer:
    """Serve on ``host:port`` from a thread of its own; returns the server (``shutdown()`` stops it)."""
    return HttpServer(service, host=host, port=port, api_key=api_key, max_body=max_body)
