"""The Tinker server's HTTP layer on aiohttp (issue 58 item 8; src/parallm/integrations/tinker/http_app.py).

Most tests run the front end in this process on a stand-in service (the routes the HTTP layer calls, the real
:class:`FutureStore` and ``retrieve_future`` route) and speak raw HTTP/1.1 on sockets:

- keep-alive: requests one after another on one connection, each answered on it;
- a long poll answers when its future completes (from another thread, as the dispatcher does), not after the
  poll timeout; a poll still pending at the timeout answers ``try_again``; a failed future its error;
- 300 long polls at once hold no thread each (the process's thread count stays below the route pool's size
  plus a few) and every one gets its own result;
- a route that blocks runs off the event loop (another connection is answered meanwhile);
- a body over the limit is refused from its header and never read: the client cannot push it through (the
  connection is closed, not drained); chunked bodies, malformed lengths (aiohttp's own parse error, in the SDK's
  JSON error body), missing / wrong keys, unknown routes; a path routed as sent (``..`` not resolved);
- ``Expect: 100-continue`` answered only after the checks;
- a refused ordered request consumes its seq id; a route's bug is a 500 naming the exception;
- shutdown with a poll and a route in flight returns promptly and frees the port;
- a streamed answer (the checkpoint archive) reaches the client while its writer still writes, holds a bounded
  number of chunks when the client does not read, ends its writer when the client leaves, and a writer failing
  after the headers leaves the client a truncated body (never a complete-looking one).

One test runs the real server (``parallm serve-tinker``, tp1, no sampler): SIGTERM while a long poll waits on a
request that cannot run (a seq-id gap) stops the server within seconds.
Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
pytest.importorskip("aiohttp")
import tinker.types  # noqa: E402,F401 - the retrieve_future route parses with it (imported once, here)

from parallm.integrations.tinker import http_app  # noqa: E402
from parallm.integrations.tinker.futures import FutureStore  # noqa: E402
from parallm.integrations.tinker.protocol import ApiError  # noqa: E402
from parallm.integrations.tinker.service import ServiceBase  # noqa: E402

pytestmark = pytest.mark.timeout(300)
KEY = "tml-http-key"


class Stub:
    """The part of the service the HTTP layer touches; ``gate`` cleared holds ``telemetry`` in its route."""
    route_retrieve_future = ServiceBase.route_retrieve_future

    def __init__(self):
        self.futures, self.refused, self.calls = FutureStore(), [], []
        self.gate = threading.Event()
        self.gate.set()

    def route_healthz(self, body):
        return {"status": "ok"}

    def route_telemetry(self, body):
        self.calls.append(("telemetry",))
        self.gate.wait(60)
        return {"status": "accepted"}

    def route_list_checkpoints(self, body, model_id):
        self.calls.append(("list", model_id))
        return {"checkpoints": [], "cursor": None}

    def route_all_checkpoints(self, body):
        self.calls.append(("all",))
        return {"checkpoints": [{"tinker_path": "tinker://everything"}]}

    def route_forward_backward(self, raw, encoding):
        self.calls.append(("forward_backward", len(raw)))
        return {"request_id": "req-0", "model_id": None}

    def route_optim_step(self, body):
        raise ApiError(400, f"optim_step: refused ({body.get('why')})")

    def route_get_info(self, body):
        return {}["no such key"]

    def route_checkpoint_archive(self, body, model_id, checkpoint_id):
        if checkpoint_id == "weights/missing":
            raise ApiError(404, "no such checkpoint")
        return ("stream", self.produce)

    def refuse(self, model_id, seq_id, message):
        self.refused.append((model_id, seq_id, message))


@contextlib.contextmanager
def serving(stub, **kw):
    srv = http_app.start_http(stub, host="127.0.0.1", port=0, api_key=KEY, **kw)
    try:
        yield srv
    finally:
        srv.shutdown()


def _connect(srv, timeout=30.0) -> socket.socket:
    return socket.create_connection(srv.server_address, timeout=timeout)


def _send(sock, method, path, body=b"", headers=None):
    head = {"Host": "x", "X-API-Key": KEY, "Content-Length": str(len(body))}
    head.update(headers or {})
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items() if v is not None]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def _read(sock):
    """``(status, lower-cased headers, body)`` of one response; ConnectionError when the peer closed first."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:]))
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside the body")
        body += chunk
    assert len(body) == length, "more bytes than one response"
    return int(lines[0].split()[1]), headers, body


def _ask(srv, method, path, body=b"", headers=None):
    with _connect(srv) as s:
        _send(s, method, path, body, headers)
        status, h, data = _read(s)
    return status, h, (json.loads(data) if data[:1] == b"{" else data)


def _poll_body(rid) -> bytes:
    return json.dumps({"request_id": rid}).encode()


def _wait_for(cond, timeout=20.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- keep-alive and long polls ------------------------------------------------------------------------------------

def test_keep_alive_requests_share_one_connection():
    stub = Stub()
    with serving(stub) as srv, _connect(srv) as s:
        for k in range(3):
            for method, path, body in (("GET", "/api/v1/healthz", b""), ("POST", "/api/v1/telemetry", b"{}")):
                _send(s, method, path, body)
                status, headers, data = _read(s)          # a ConnectionError if the server closed after one
                assert status == 200 and headers.get("connection", "").lower() != "close", (k, path, headers)
        assert stub.calls == [("telemetry",)] * 3


def test_long_poll_answers_when_the_future_completes(monkeypatch):
    stub = Stub()
    with serving(stub) as srv:
        rid = stub.futures.create("forward")
        threading.Timer(0.5, stub.futures.resolve, (rid, ("json", {"loss": 1.5}))).start()
        t0 = time.perf_counter()
        status, _, body = _ask(srv, "POST", "/api/v1/retrieve_future", _poll_body(rid))
        took = time.perf_counter() - t0
        assert status == 200 and body == {"loss": 1.5}, body
        assert 0.4 < took < 5.0, f"the poll answered after {took:.2f} s (its future completed at 0.5 s)"
        failed = stub.futures.create("forward")
        threading.Timer(0.2, stub.futures.fail, (failed, "bad datum"), {"category": "user"}).start()
        assert _ask(srv, "POST", "/api/v1/retrieve_future", _poll_body(failed))[2] == \
            {"error": "bad datum", "category": "user"}
        status, _, body = _ask(srv, "POST", "/api/v1/retrieve_future", _poll_body("req-999"))
        assert status == 404 and "req-999" in body["error"]
        monkeypatch.setattr(http_app, "LONG_POLL_S", 0.5)
        pending = stub.futures.create("forward")
        t0 = time.perf_counter()
        status, _, body = _ask(srv, "POST", "/api/v1/retrieve_future", _poll_body(pending))
        took = time.perf_counter() - t0
        assert body == {"type": "try_again", "request_id": pending, "queue_state": "active"}, body
        assert 0.45 < took < 5.0, took
        assert stub.futures.watched() == 0, "a timed-out poll left its callback behind"


def test_many_long_polls_hold_no_thread():
    stub = Stub()
    n = 300
    with serving(stub) as srv:
        base = threading.active_count()
        rids = [stub.futures.create("forward") for _ in range(n)]
        socks = [_connect(srv) for _ in range(n)]
        try:
            for s, rid in zip(socks, rids):
                _send(s, "POST", "/api/v1/retrieve_future", _poll_body(rid))
            _wait_for(lambda: stub.futures.watched() == n, what=f"{n} polls held")
            grown = threading.active_count() - base
            assert grown <= http_app.ROUTE_THREADS + 2, f"{n} long polls took {grown} threads"
            t0 = time.perf_counter()
            assert _ask(srv, "GET", "/api/v1/healthz")[0] == 200
            assert time.perf_counter() - t0 < 5.0
            for k, rid in enumerate(rids):                 # from one thread, as the dispatcher completes them
                stub.futures.resolve(rid, ("json", {"k": k}))
            for k, s in enumerate(socks):
                status, _, body = _read(s)
                assert status == 200 and json.loads(body) == {"k": k}
        finally:
            for s in socks:
                s.close()


def test_a_blocking_route_runs_off_the_loop():
    stub = Stub()
    stub.gate.clear()
    with serving(stub) as srv, _connect(srv) as held:
        _send(held, "POST", "/api/v1/telemetry", b"{}")
        _wait_for(lambda: stub.calls == [("telemetry",)], what="the route to start")
        t0 = time.perf_counter()
        assert _ask(srv, "GET", "/api/v1/healthz")[0] == 200
        assert time.perf_counter() - t0 < 5.0, "a route blocked the event loop"
        stub.gate.set()
        assert _read(held)[0] == 200


# -- limits, errors, paths ----------------------------------------------------------------------------------------

def test_oversized_body_is_refused_unread():
    stub = Stub()
    total, cap = 256 << 20, 1 << 20
    with serving(stub, max_body=cap) as srv, _connect(srv) as s:
        _send(s, "POST", "/api/v1/forward_backward", b"", {"Content-Length": str(total),
                                                           "Content-Type": "application/x-protobuf"})
        status, headers, body = _read(s)
        assert status == 413 and "--max-body-mb" in json.loads(body)["error"], body
        sent, chunk = 0, bytes(1 << 20)
        with pytest.raises(OSError):                     # the server closed the connection: nothing drains it
            while sent < total:
                sent += s.send(chunk)
        assert sent < total // 8, f"{sent >> 20} MiB of a refused body went through"
    assert stub.calls == []


def test_expect_continue_only_after_the_checks():
    """A client that sends ``Expect: 100-continue`` (curl, for bodies over 1 kB) gets the interim 100 once the
    route, key and size passed, and the refusal instead of it when they did not (its body never sent)."""
    stub = Stub()
    with serving(stub, max_body=1 << 20) as srv:
        with _connect(srv) as s:
            _send(s, "POST", "/api/v1/telemetry", b"", {"Content-Length": "2", "Expect": "100-continue"})
            assert _read(s)[0] == 100
            s.sendall(b"{}")
            assert _read(s)[0] == 200
        with _connect(srv) as s:
            _send(s, "POST", "/api/v1/telemetry", b"", {"Content-Length": str(2 << 20), "Expect": "100-continue"})
            assert _read(s)[0] == 413
    assert stub.calls == [("telemetry",)]


def test_refusals_before_the_body():
    stub = Stub()
    with serving(stub, max_body=1 << 20) as srv:
        status, h, body = _ask(srv, "POST", "/api/v1/telemetry", b"{}", {"Content-Length": "12abc"})
        assert status == 400 and "Content-Length" in body["error"] and body["category"] == "user", body
        status, _, body = _ask(srv, "POST", "/api/v1/telemetry", b"2\r\n{}\r\n0\r\n\r\n",
                               {"Content-Length": None, "Transfer-Encoding": "chunked"})
        assert status == 411, body
        with _connect(srv) as s:                         # the key before the body: a 401 to the header alone
            _send(s, "POST", "/api/v1/forward_backward", b"", {"X-API-Key": "tml-wrong", "Content-Length": "3000000"})
            status, h, body = _read(s)
            assert status == 401 and h.get("connection") == "close" and b"invalid API key" in body
        assert _ask(srv, "POST", "/api/v1/telemetry", b"{}", {"X-API-Key": None})[0] == 401
        assert _ask(srv, "GET", "/api/v1/healthz", b"", {"X-API-Key": None})[0] == 200
        status, _, body = _ask(srv, "PATCH", "/api/v1/nothing/here")
        assert status == 404 and body["error"] == "PATCH /api/v1/nothing/here is not offered by parallm's Tinker server"
        status, _, body = _ask(srv, "POST", "/api/v1/telemetry", b"{}", {"X-Stainless-Package-Version": "0.41.0"})
        assert status == 400 and "0.38" in body["error"]
    assert stub.calls == []


def test_paths_are_routed_as_sent():
    stub = Stub()
    with serving(stub) as srv:
        status, _, body = _ask(srv, "GET", "/api/v1/training_runs/../checkpoints")
        assert status == 200 and "tinker_path" not in json.dumps(body), body
        assert _ask(srv, "GET", "/api/v1/training_runs/m%2F1/checkpoints?x=1")[0] == 200
    assert stub.calls == [("list", ".."), ("list", "m%2F1")]


def test_refused_request_consumes_its_seq_id_and_bugs_are_500s():
    stub = Stub()
    with serving(stub) as srv, _connect(srv) as s:
        body = json.dumps({"model_id": "m-1", "seq_id": 7, "why": "no gradients"}).encode()
        _send(s, "POST", "/api/v1/optim_step", body)
        status, _, data = _read(s)
        assert status == 400 and json.loads(data)["error"] == "optim_step: refused (no gradients)"
        assert stub.refused == [("m-1", 7, "optim_step: refused (no gradients)")]
        _send(s, "POST", "/api/v1/get_info", b"{}")               # the same connection, still open after a 400
        status, _, data = _read(s)
        assert status == 500 and json.loads(data) == {"error": "KeyError: 'no such key'", "category": "server"}
        _send(s, "POST", "/api/v1/forward_backward", b"\x01\x02\x03", {"Content-Encoding": "zstd"})
        assert _read(s)[0] == 200                       # the body reaches the route as sent (no decompression)
    assert stub.calls == [("forward_backward", 3)]


# -- shutdown -----------------------------------------------------------------------------------------------------

def test_shutdown_with_a_poll_and_a_route_in_flight():
    stub = Stub()
    stub.gate.clear()
    srv = http_app.start_http(stub, host="127.0.0.1", port=0, api_key=KEY)
    rid = stub.futures.create("forward")
    poll, busy = _connect(srv), _connect(srv)
    try:
        _send(poll, "POST", "/api/v1/retrieve_future", _poll_body(rid))
        _send(busy, "POST", "/api/v1/telemetry", b"{}")
        _wait_for(lambda: stub.futures.watched() == 1 and stub.calls, what="the poll and the route")
        t0 = time.perf_counter()
        srv.shutdown()
        took = time.perf_counter() - t0
        assert took < http_app.SHUTDOWN_S + 3, f"shutdown took {took:.1f} s"
        poll.settimeout(5)
        try:
            status, _, body = _read(poll)
            assert json.loads(body)["type"] == "try_again"
        except ConnectionError:
            pass                                        # closed without an answer: also prompt
        assert not srv._thread.is_alive()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(srv.server_address, timeout=5).close()
    finally:
        stub.gate.set()
        poll.close()
        busy.close()


def test_a_poll_arriving_while_stopping_is_not_held():
    """Between shutdown's start and the connections' close, a poll on a pending request answers ``try_again``
    at once (it must not fall through to the route, which would hold the loop for the whole poll timeout)."""
    stub = Stub()
    with serving(stub) as srv, _connect(srv, timeout=5) as s:
        rid = stub.futures.create("forward")
        srv._loop.call_soon_threadsafe(setattr, srv, "_stopped", True)        # shutdown's first step alone
        t0 = time.perf_counter()
        _send(s, "POST", "/api/v1/retrieve_future", _poll_body(rid))
        status, _, body = _read(s)
        assert json.loads(body)["type"] == "try_again" and time.perf_counter() - t0 < 2.0


# -- streamed answers -----------------------------------------------------------------------------------------------

ARCHIVE = "/api/v1/training_runs/run-0/checkpoints/weights/big/archive"


def _get_streamed(srv, path=ARCHIVE, timeout=30.0):
    conn = http.client.HTTPConnection(*srv.server_address, timeout=timeout)
    conn.request("GET", path, headers={"X-API-Key": KEY})
    return conn, conn.getresponse()


def test_streamed_answer_arrives_while_written():
    """The first chunk reaches the client while the writer waits for the client to have it: the answer is not
    built whole first; the rest follows and the body ends properly (the final chunk)."""
    chunk = http_app.STREAM_CHUNK
    got_first = threading.Event()
    parts = [bytes([i]) * chunk for i in range(3)] + [b"tail"]

    def produce(out):
        out.write(parts[0])
        assert got_first.wait(20), "the first chunk never reached the client"
        for p in parts[1:]:
            out.write(p)
    stub = Stub()
    stub.produce = produce
    with serving(stub) as srv:
        conn, resp = _get_streamed(srv)
        try:
            assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
            assert resp.getheader("Content-Type") == "application/gzip"
            assert resp.read(chunk) == parts[0]
            got_first.set()
            assert resp.read() == b"".join(parts[1:])
        finally:
            conn.close()
        status, _, body = _ask(srv, "GET", "/api/v1/training_runs/run-0/checkpoints/weights/missing/archive")
        assert status == 404 and "no such checkpoint" in body["error"]


def test_streamed_answer_holds_few_chunks_when_the_client_does_not_read():
    """A client that reads nothing stalls the writer after the queue and the sockets' buffers are full (a few
    chunks of 64), and when it reads, every byte arrives in order."""
    chunk, total = http_app.STREAM_CHUNK, 64
    written = []

    def produce(out):
        for i in range(total):
            out.write(i.to_bytes(4, "little") * (chunk // 4))
            written.append(i)
    stub = Stub()
    stub.produce = produce
    with serving(stub) as srv:
        conn, resp = _get_streamed(srv)
        try:
            time.sleep(1.5)                                    # the client reads nothing meanwhile
            held = len(written)
            assert held < 24, f"{held} of {total} chunks written while the client read nothing"
            for i in range(total):
                assert resp.read(chunk) == i.to_bytes(4, "little") * (chunk // 4), f"chunk {i}"
            assert resp.read() == b"" and len(written) == total
        finally:
            conn.close()


def test_streamed_answer_ends_its_writer_when_the_client_leaves():
    ended, written = threading.Event(), []

    def produce(out):
        try:
            while True:
                out.write(b"x" * http_app.STREAM_CHUNK)
                written.append(1)
        finally:
            ended.set()
    stub = Stub()
    stub.produce = produce
    with serving(stub) as srv:
        conn, resp = _get_streamed(srv)
        resp.read(http_app.STREAM_CHUNK)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert ended.wait(20), "the writer kept writing after the client left"
        assert _ask(srv, "GET", "/api/v1/healthz")[0] == 200


def test_streamed_answer_failing_after_the_headers_is_truncated():
    def produce(out):
        out.write(b"y" * (http_app.STREAM_CHUNK + 10))
        raise OSError("disk gone")
    stub = Stub()
    stub.produce = produce
    with serving(stub) as srv:
        conn, resp = _get_streamed(srv)
        try:
            assert resp.status == 200
            with pytest.raises(http.client.IncompleteRead):
                resp.read()
        finally:
            conn.close()
        assert _ask(srv, "GET", "/api/v1/healthz")[0] == 200


def test_server_stops_with_a_poll_in_flight(tmp_path):
    """The real server (server.py's stop path): SIGTERM while ``retrieve_future`` waits on a request that
    cannot run yet (seq id 2 of a client whose seq id 1 never came) stops every rank within seconds."""
    import tinker_helpers as th
    from tinker.proto import tinker_public_pb2 as pb
    model = th.tiny_model(str(tmp_path / "model"), seed=3)
    srv = th.Server(model, str(tmp_path), tp=1, sampler="none", api_key=KEY)
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=KEY).create_lora_training_client(
            base_model=model, rank=8, train_unembed=False).result()
        req = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=2, loss_fn="cross_entropy", forward_only=True)
        d = req.data.add()
        d.model_input.add().encoded_text.tokens = np.arange(3, 9, dtype=np.int32).tobytes()
        for name, v, dtype in (("target_tokens", np.arange(4, 10, dtype=np.int64), pb.DTYPE_INT64),
                               ("weights", np.ones(6, np.float32), pb.DTYPE_FLOAT32)):
            t = d.loss_fn_inputs[name]
            t.dtype, t.dense = dtype, v.tobytes()
            t.shape.append(6)
        u = urlsplit(srv.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/api/v1/forward_backward", body=req.SerializeToString(),
                     headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"})
        rid = json.loads(conn.getresponse().read())["request_id"]
        answer = {}

        def poll():
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/api/v1/retrieve_future", body=_poll_body(rid), headers={"X-API-Key": KEY})
                answer["body"] = json.loads(conn.getresponse().read())
            except (OSError, http.client.HTTPException) as e:
                answer["error"] = repr(e)
            answer["took"] = time.perf_counter() - t0
        waiter = threading.Thread(target=poll)
        waiter.start()
        time.sleep(2.0)
        assert waiter.is_alive(), f"the poll of a request that cannot run answered: {answer}"
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        took = time.perf_counter() - t0
        waiter.join(30)
        print(f"SIGTERM to exit with a poll in flight: {took:.2f} s; the poll: {answer}")
        assert not waiter.is_alive() and answer["took"] < 2.0 + took + 5, answer
        assert answer.get("body", {}).get("type", "try_again") == "try_again", answer
        assert took < 20, f"the server took {took:.1f} s to stop with a poll in flight"
    finally:
        srv.stop()
