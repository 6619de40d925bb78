"""The HTTP front end (rank 0): the standard library's threading HTTP server, one thread per connection, routes
``(method, path)`` to the service's ``route_*`` methods.

Trust model: the server binds ``127.0.0.1`` unless told otherwise (``--host``); every request must carry the
SDK's ``X-API-Key`` header, and when the server was given a key (``--api-key`` or ``PARALLM_TINKER_API_KEY``)
it must be that key (constant-time comparison), else 401. Without a key any key is accepted: anyone who reaches
the port can train and sample. There is no TLS: put a TLS proxy in front to serve beyond a trusted network.

Size: the route and the key are checked before the body is read; a body above ``max_body`` bytes
(``--max-body-mb``) is a 413 and a malformed ``Content-Length`` a 400, both without reading it.

A refused request that carries a training client's ``model_id`` and ``seq_id`` consumes that seq id with its
error (:meth:`.service.ServiceBase.refuse`): the client's later requests run at once instead of waiting for it.

An unknown route is a 404 with the SDK's error body naming the method and path ("not offered by parallm's
Tinker server"); a bug in a route is a 500 naming the exception (the SDK retries 5xx: routes raise
:class:`.protocol.ApiError` for everything a client can cause).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .protocol import DEFAULT_MAX_BODY, PROTO, ApiError, check_sdk_version, json_body, request_ids

__all__ = ["ROUTES", "start_http"]

log = logging.getLogger("parallm.tinker")

# (method, path regex) -> service method; path groups become arguments
ROUTES = [
    ("GET", r"/api/v1/healthz", "route_healthz"),
    ("GET", r"/api/v1/get_server_capabilities", "route_capabilities"),
    ("POST", r"/api/v1/client/config", "route_client_config"),
    ("POST", r"/api/v1/client/dynamic_config", "route_dynamic_config"),
    ("POST", r"/api/v1/telemetry", "route_telemetry"),
    ("POST", r"/api/v1/cancel_future", "route_cancel_future"),
    ("POST", r"/api/v1/create_session", "route_create_session"),
    ("POST", r"/api/v1/session_heartbeat", "route_heartbeat"),
    ("POST", r"/api/v1/sessions/([^/]+)/finish", "route_finish_session"),
    ("POST", r"/api/v1/retrieve_future", "route_retrieve_future"),
    ("POST", r"/api/v1/create_model", "route_create_model"),
    ("POST", r"/api/v1/get_info", "route_get_info"),
    ("POST", r"/api/v1/forward_backward", "route_forward_backward"),
    ("POST", r"/api/v1/optim_step", "route_optim_step"),
    ("POST", r"/api/v1/save_weights", "route_save_weights"),
    ("POST", r"/api/v1/load_weights", "route_load_weights"),
    ("POST", r"/api/v1/save_weights_for_sampler", "route_save_for_sampler"),
    ("POST", r"/api/v1/create_sampling_session", "route_create_sampling_session"),
    ("POST", r"/api/v1/asample", "route_asample"),
    ("GET", r"/api/v1/samplers/([^/]+)", "route_get_sampler"),
    ("POST", r"/api/v1/weights_info", "route_weights_info"),
    ("GET", r"/api/v1/training_runs", "route_training_runs"),
    ("GET", r"/api/v1/training_runs/([^/]+)", "route_training_run"),
    ("GET", r"/api/v1/training_runs/([^/]+)/checkpoints", "route_list_checkpoints"),
    ("DELETE", r"/api/v1/training_runs/([^/]+)/checkpoints/(.+)", "route_delete_checkpoint"),
    ("PUT", r"/api/v1/training_runs/([^/]+)/checkpoints/(.+)/ttl", "route_checkpoint_ttl"),
    ("GET", r"/api/v1/training_runs/([^/]+)/checkpoints/(.+)/archive", "route_checkpoint_archive"),
    ("GET", r"/api/v1/checkpoints", "route_all_checkpoints"),
    ("GET", r"/api/v1/sessions", "route_list_sessions"),
    ("GET", r"/api/v1/sessions/([^/]+)", "route_get_session"),
    ("POST", r"/api/v1/unload_model", "route_unload_model"),
]
_COMPILED = [(m, re.compile(p + r"/?"), name) for m, p, name in ROUTES]


def match_route(method: str, path: str):
    """``(service method name, regex match)`` of a request; a 404 naming it when no route takes it."""
    for m, pattern, name in _COMPILED:
        match = pattern.fullmatch(path)
        if match and m == method:
            return name, match
    raise ApiError(404, f"{method} {path} is not offered by parallm's Tinker server")


def read_body(handler, max_body: int) -> bytes:
    """The request body, read only after the route and the key were checked and only up to the cap: a missing
    or malformed ``Content-Length`` is a 400 (411 for a chunked body), one above ``max_body`` a 413, both answered
    without reading the body (the connection is then closed)."""
    if handler.headers.get("Transfer-Encoding"):
        raise ApiError(411, "a Content-Length is required (chunked request bodies are not accepted)")
    value = handler.headers.get("Content-Length")
    if value is None:
        return b""
    if not value.strip().isdigit():
        raise ApiError(400, f"bad Content-Length {value!r}")
    length = int(value)
    if length > max_body:
        raise ApiError(413, f"the request body has {length} bytes; this server takes at most {max_body} "
                            "(parallm serve-tinker --max-body-mb)")
    raw = handler.rfile.read(length) if length else b""
    if len(raw) != length:
        raise ApiError(400, f"the body ended after {len(raw)} of {length} bytes")
    return raw


def _make_handler(service, api_key: str | None, max_body: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "parallm-tinker"
        # Responses go through a buffered writer (headers and a small body in one send) on a socket with
        # TCP_NODELAY: with Nagle's algorithm on, the last piece of a response written in two waited for the
        # client's delayed ACK of the first (about 40 ms on Linux) on every response (issue 47's overhead).
        wbufsize = -1
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):      # quiet: one line per error only
            pass

        def _send(self, status: int, payload, content_type="application/json"):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _auth(self):
            key = self.headers.get("X-API-Key")
            if not key:
                raise ApiError(401, "missing X-API-Key header (the SDK sends TINKER_API_KEY / api_key)")
            if api_key is not None and not hmac.compare_digest(key.encode(), api_key.encode()):
                raise ApiError(401, "invalid API key for this server")

        def _dispatch(self, method: str):
            path = self.path.split("?", 1)[0]
            ids, read = None, False
            try:
                check_sdk_version(self.headers.get("X-Stainless-Package-Version"))
                name, match = match_route(method, path)
                if name != "route_healthz":
                    self._auth()
                raw, read = read_body(self, max_body), True
                fn = getattr(service, name)
                if name == "route_forward_backward":
                    result = fn(raw, self.headers.get("Content-Encoding"))
                else:
                    body = json_body(raw, route=path) if raw else {}
                    ids = request_ids(body)
                    result = fn(body, *match.groups())
                if isinstance(result, tuple):     # ("json", dict) / ("proto", bytes) / ("bytes", a gzipped tar)
                    kind, value = result
                    self._send(200, value, {"proto": PROTO, "bytes": "application/gzip"}.get(kind, "application/json"))
                else:
                    self._send(200, result)
            except ApiError as e:
                refused = e.ids or ids          # a refused ordered request consumes its seq id (no 60 s stall)
                if refused is not None:
                    service.refuse(*refused, e.message)
                if not read:                    # the body is still in the socket: this connection is done
                    self.close_connection = True
                self._send(e.status, e.body())
            except Exception as e:  # noqa: BLE001 - a server bug: say which
                log.exception("%s %s failed", method, path)
                self._send(500, {"error": f"{type(e).__name__}: {e}", "category": "server"})

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def do_DELETE(self):
            self._dispatch("DELETE")

        def do_PUT(self):
            self._dispatch("PUT")

    return Handler


def start_http(service, *, host: str, port: int, api_key: str | None,
               max_body: int = DEFAULT_MAX_BODY) -> ThreadingHTTPServer:
    """Serve on ``host:port`` from a daemon thread; returns the server (``shutdown()`` stops it)."""
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer((host, port), _make_handler(service, api_key, max_body))
    threading.Thread(target=server.serve_forever, name="tinker-http", daemon=True).start()
    return server
