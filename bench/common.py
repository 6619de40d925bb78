"""Shared pieces of the benchmarks: a gloo launcher and memory sampling (no test-suite imports)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, queue, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    import torch
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "err", traceback.format_exc()))


def run_world(fn, world: int, *args, timeout: float = 1800):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=5)
        except Exception:  # noqa: BLE001
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        if status != "ok":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(results) < world:
        raise RuntimeError(f"benchmark world did not finish (got ranks {sorted(results)})")
    return [results[r] for r in range(world)]


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    def __init__(self, period=0.002):
        self.period = period
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())


def table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = " | ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    out = [line, "-|-".join("-" * w for w in widths)]
    out += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
