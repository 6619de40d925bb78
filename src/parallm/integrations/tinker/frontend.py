"""What an HTTP request to the Tinker server means, apart from the server library that carries it
(:mod:`.http_app`, aiohttp): the routes ``(method, path)`` -> the service's ``route_*`` methods, the checks made
on a request's headers before its body is read, and one route run on a read body.

Trust model: the server binds ``127.0.0.1`` unless told otherwise (``--host``); every request must carry the
SDK's ``X-API-Key`` header, and when the server was given a key (``--api-key`` or ``PARALLM_TINKER_API_KEY``)
it must be that key (constant-time comparison), else 401. Without a key any key is accepted: anyone who reaches
the port can train and sample. There is no TLS: put a TLS proxy in front to serve beyond a trusted network.

Size: the route and the key are checked before the body is read; a body above ``max_body`` bytes
(``--max-body-mb``) is a 413, a malformed ``Content-Length`` a 400 and a chunked body a 411, all without reading
it (the connection is then closed).

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

from .protocol import PROTO, ApiError, check_sdk_version, json_body, request_ids

__all__ = ["ROUTES", "check_request", "match_route", "run_route"]

log = logging.getLogger("parallm.tinker")
JSON = "application/json"
# a route's ("kind", value): "stream"'s value is a callable writing the body to a file-like (see http_app)
CONTENT_TYPES = {"json": JSON, "proto": PROTO, "bytes": "application/gzip", "stream": "application/gzip"}

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


def body_length(headers, max_body: int) -> int:
    """The body's length from the headers alone: 0 without a ``Content-Length``; a malformed one is a 400, a
    chunked body a 411, one above ``max_body`` a 413."""
    if headers.get("Transfer-Encoding"):
        raise ApiError(411, "a Content-Length is required (chunked request bodies are not accepted)")
    value = headers.get("Content-Length")
    if value is None:
        return 0
    if not value.strip().isdigit():
        raise ApiError(400, f"bad Content-Length {value!r}")
    length = int(value)
    if length > max_body:
        raise ApiError(413, f"the request body has {length} bytes; this server takes at most {max_body} "
                            "(parallm serve-tinker --max-body-mb)")
    return length


def check_auth(headers, api_key: str | None) -> None:
    key = headers.get("X-API-Key")
    if not key:
        raise ApiError(401, "missing X-API-Key header (the SDK sends TINKER_API_KEY / api_key)")
    if api_key is not None and not hmac.compare_digest(key.encode(), api_key.encode()):
        raise ApiError(401, "invalid API key for this server")


def check_request(method: str, path: str, headers, *, api_key: str | None, max_body: int):
    """Everything decided before the body is read: ``(route name, path match, body length)``; an
    :class:`ApiError` (SDK version, route, key, size) otherwise. Pure: no lock, no I/O."""
    check_sdk_version(headers.get("X-Stainless-Package-Version"))
    name, match = match_route(method, path)
    if name != "route_healthz":
        check_auth(headers, api_key)
    return name, match, body_length(headers, max_body)


def run_route(service, name: str, match, raw: bytes, headers, path: str) -> tuple[int, bytes, str]:
    """One route on its read body: ``(status, body bytes, content type)``, or for a streamed answer
    ``(200, a callable writing the body to a file-like, content type)``; never raises. A refused ordered
    request consumes its seq id. Synchronous, may block briefly (the service's lock, the dispatcher's queue)."""
    ids = None
    try:
        fn = getattr(service, name)
        if name == "route_forward_backward":
            result = fn(raw, headers.get("Content-Encoding"))
        else:
            body = json_body(raw, route=path) if raw else {}
            ids = request_ids(body)
            result = fn(body, *match.groups())
        kind, value = result if isinstance(result, tuple) else ("json", result)
        if kind == "stream":
            return 200, value, CONTENT_TYPES[kind]
        return 200, (value if isinstance(value, bytes) else json.dumps(value).encode()), CONTENT_TYPES.get(kind, JSON)
    except ApiError as e:
        refused = e.ids or ids          # a refused ordered request consumes its seq id (no 60 s stall)
        if refused is not None:
            service.refuse(*refused, e.message)
        return e.status, json.dumps(e.body()).encode(), JSON
    except Exception as e:  # noqa: BLE001 - a server bug: say which
        log.exception("%s failed", path)
        return 500, json.dumps({"error": f"{type(e).__name__}: {e}", "category": "server"}).encode(), JSON
