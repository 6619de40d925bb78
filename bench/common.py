"""Shared pieces of the benchmarks: local ranks (parallm.verify.spawn, as the tests and the command line use) and
memory sampling (no test-suite imports)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(fn, world: int, *args, timeout: float = 1800):
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (torch.distributed initialised, one thread each,
    progress bars off); the results by rank. A failing rank raises parallm.verify.SpawnError naming it."""
    from parallm.verify import spawn
    return spawn(fn, world, *args, timeout=timeout, env={"PARALLM_PROGRESS": "0"})


def write_shards(path: str, tensors, shard_bytes: int) -> tuple[int, int, int]:
    """``(name, tensor)`` pairs written as HF safetensors shards of at most ``shard_bytes`` (a tensor larger than
    that alone in its shard) plus ``model.safetensors.index.json``. Returns (total bytes, largest tensor's bytes,
    number of files)."""
    from safetensors.torch import save_file
    files, current, size, total, largest = [], {}, 0, 0, 0
    for name, x in tensors:
        n = x.numel() * x.element_size()
        if current and size + n > shard_bytes:
            files.append(current)
            current, size = {}, 0
        current[name] = x
        size += n
        total += n
        largest = max(largest, n)
    files.append(current)
    weight_map = {}
    for k, part in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, largest, len(files)


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


def peak_and_best(step, iters: int) -> tuple[float, float]:
    """``(peak anonymous RSS above the level before, in MiB, of one call of step(); the best of ``iters`` more
    calls' wall times, in s)``."""
    before = rss_anon()
    with PeakRss() as peak:
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return (peak.peak - before) / 2**20, min(times)


def table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = " | ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    out = [line, "-|-".join("-" * w for w in widths)]
    out += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def one_process_pair(hf, *, batch: int, seq: int, loss, prefix: str):
    """The same model on both sides of a one-process training-step comparison: ``hf`` (a transformers model,
    already built and seeded) saved to a temporary checkpoint, parallm initialised at world 1 and built from it,
    and a seeded full-length batch. Returns ``(chunks, hf_step, pl_step, ckpt)``: each step zeroes its own
    gradients and runs forward + ``loss(logits, ids, mask)`` + backward on the same batch."""
    import tempfile

    import torch

    import parallm
    ckpt = tempfile.mkdtemp(prefix=prefix)
    hf.save_pretrained(ckpt)
    parallm.init_parallel(tp=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    pos = parallm.default_position_ids(mask)

    def hf_step():
        hf.zero_grad(set_to_none=True)
        out = hf(input_ids=ids, attention_mask=mask, position_ids=pos)
        loss(out.logits, ids, mask).backward()

    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)

    def pl_step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        parallm.forward_backward(chunks, ids, mask, loss_fn=loss)

    return chunks, hf_step, pl_step, ckpt
