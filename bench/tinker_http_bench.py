"""The Tinker server's HTTP front end alone (issue 58 item 8): per-request latency on one kept-alive
connection against a stand-in service (no model, no ranks), so that the HTTP layer's share of a round can be
seen on a loaded machine where bench/tinker_bench.py's rounds scatter by more than it. Needs .venv-tinker.

    OMP_NUM_THREADS=1 .venv-tinker/bin/python bench/tinker_http_bench.py [N]

Runs whichever front end the parallm on the path has: aiohttp (``http_app.start_http``) or, on a tree from
before it, the standard library's (``frontend.start_http``): run the two trees alternately. Medians over N
requests of ``healthz`` (GET), ``telemetry`` (POST ``{}``), ``retrieve_future`` of a finished request, and
``poll_wake``: a long poll on a pending request completed 5 ms later from another thread (as the dispatcher
completes it), timed from the completion to the response's arrival.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time

import tinker.types  # noqa: F401 - the retrieve_future route parses with it: imported before timing

from parallm.integrations.tinker.futures import FutureStore
from parallm.integrations.tinker.service import ServiceBase

try:
    from parallm.integrations.tinker.http_app import start_http
    KIND = "aiohttp"
except ImportError:
    from parallm.integrations.tinker.frontend import start_http
    KIND = "stdlib"
HEADERS = {"X-API-Key": "tml-bench", "Content-Type": "application/json"}


class Stub:
    route_retrieve_future = ServiceBase.route_retrieve_future

    def __init__(self):
        self.futures = FutureStore()

    def route_healthz(self, body):
        return {"status": "ok"}

    def route_telemetry(self, body):
        return {"status": "accepted"}


def main(n: int) -> None:
    stub = Stub()
    srv = start_http(stub, host="127.0.0.1", port=0, api_key=None)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)

    def one(method, path, body=None):
        t0 = time.perf_counter()
        conn.request(method, path, body=body, headers=HEADERS)
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        return time.perf_counter() - t0
    out = {}
    for name, args in (("healthz", ("GET", "/api/v1/healthz")), ("telemetry", ("POST", "/api/v1/telemetry", b"{}"))):
        one(*args)
        out[name] = statistics.median(one(*args) for _ in range(n))
    done = stub.futures.create("x")
    stub.futures.resolve(done, ("json", {"a": 1}))
    body = json.dumps({"request_id": done}).encode()
    out["retrieve_done"] = statistics.median(one("POST", "/api/v1/retrieve_future", body) for _ in range(n))
    wake = []
    for _ in range(n // 2):
        rid, box = stub.futures.create("x"), {}

        def complete(rid=rid, box=box):
            time.sleep(0.005)
            box["t"] = time.perf_counter()
            stub.futures.resolve(rid, ("json", {"a": 1}))
        t = threading.Thread(target=complete)
        t.start()
        conn.request("POST", "/api/v1/retrieve_future", body=json.dumps({"request_id": rid}).encode(),
                     headers=HEADERS)
        conn.getresponse().read()
        arrived = time.perf_counter()
        t.join()
        wake.append(arrived - box["t"])
    out["poll_wake"] = statistics.median(wake)
    srv.shutdown()
    print(KIND, " ".join(f"{k} {v * 1e3:.2f} ms" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
