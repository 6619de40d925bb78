"""Starting the ranks: under torchrun (use its world, in-process) or standalone (spawn local processes).

Standalone: ``world`` processes forked from a forkserver that imported torch, megatron-core, parallm and
transformers once (:mod:`parallm.cli_impl.preload`; a rank starts in well under a second), each with RANK /
WORLD_SIZE / LOCAL_RANK, one thread (OMP_NUM_THREADS=1), a ``file://`` rendezvous in a fresh temporary
directory (no port to pick, no race for it), gloo on CPU (GPUs hidden from the ranks) or nccl when there is a
GPU per rank. The launcher polls them: a rank that exits with an error or dies ends the run after a short grace
period (the others get to report the same error); past ``timeout`` every rank is killed. It never waits forever.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .common import UsageError, one_line

GRACE_S = 5.0           # after the first rank fails, how long the others get to write their own report
AGREED_TYPES = ("CheckpointError", "ValueError", "FileNotFoundError", "ParallelError", "CLIError", "UsageError")


def under_torchrun() -> bool:
    """True when a launcher (torchrun, or anything that sets RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend(device: str, local_ranks: int) -> str:
    """gloo (CPU) or nccl (one GPU per local rank)."""
    if device == "cpu":
        return "gloo"
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda":
        if n < local_ranks:
            raise UsageError(f"--device cuda needs one GPU per rank: {local_ranks} rank(s), {n} GPU(s) visible")
        return "nccl"
    return "nccl" if n >= local_ranks else "gloo"


def device_words(backend: str) -> str:
    return "nccl on GPUs" if backend == "nccl" else "gloo on CPU"


@dataclass
class LaunchResult:
    ok: bool                                  # every rank finished without an error
    rows: list = field(default_factory=list)  # rank 0's result rows (partial when a rank failed)
    info: dict = field(default_factory=dict)
    error: str | None = None                  # one line
    detail: str | None = None                 # a traceback or a log tail (printed with --debug, or for crashes)


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f", killed by {signal.Signals(-code).name}" + (" (out of memory?)" if -code == 9 else "")
        except ValueError:
            pass
    return ""


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def _is_connection_error(message: str) -> bool:
    m = message.lower()
    return any(s in m for s in ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                                "socket", "connection refused"))


def _context():
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["parallm.cli_impl.preload"])
    return ctx


def spawn(job: dict, world: int, *, timeout: float, progress, debug: bool = False) -> LaunchResult:
    """Run ``job`` on ``world`` local ranks; never blocks longer than ``timeout`` (plus the grace period)."""
    from .worker import run_rank
    tmp = tempfile.mkdtemp(prefix="parallm-ranks-")
    job = dict(job, rendezvous=os.path.join(tmp, "rendezvous"))
    job_path = os.path.join(tmp, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    # The forkserver (and so every rank) inherits this process's environment when it starts.
    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        os.environ.pop(k, None)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                      PARALLM_TIMEOUT_S=str(timeout), PARALLM_PROGRESS="0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # only local directories are read; never wait for a network
    if job.get("backend") != "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # CPU ranks: keep the CUDA code paths out entirely
    ctx = _context()
    start = time.monotonic()
    procs, logs = [], []
    try:
        for r in range(world):
            logs.append(os.path.join(tmp, f"rank-{r}.log"))
            env = dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
            p = ctx.Process(target=run_rank, args=(r, world, job_path, tmp, env, logs[-1]), daemon=True)
            p.start()
            procs.append(p)
        return _watch(procs, logs, tmp, world, timeout, progress, debug, start)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        if debug:
            print(f"(--debug: rank logs kept in {tmp})", file=sys.stderr)
        else:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)


def _watch(procs, logs, tmp, world, timeout, progress, debug, start) -> LaunchResult:
    deadline = start + timeout
    progress_path = os.path.join(tmp, "progress.txt")
    shown = 0
    first_failure = None
    timed_out = False

    def show_progress():
        nonlocal shown
        try:
            with open(progress_path) as f:
                text = f.read()
        except OSError:
            return
        complete = text[:text.rfind("\n") + 1].splitlines()  # a line being written is shown next time
        for line in complete[shown:]:
            progress(f"[{time.monotonic() - start:5.1f}s] {line}")
        shown = len(complete)

    while True:
        show_progress()
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
        if first_failure is not None and now - first_failure > GRACE_S:
            break
        if now > deadline:
            timed_out = True
            break
        time.sleep(0.1)
    show_progress()
    codes = [p.exitcode for p in procs]
    running = [r for r, c in enumerate(codes) if c is None]

    results = {}
    for r in range(world):
        try:
            with open(os.path.join(tmp, f"rank-{r}.json")) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            pass
    rank0 = results.get(0, {})
    rows, info = rank0.get("rows", []), rank0.get("info", {})
    if not running and all(c == 0 for c in codes) and all(results.get(r, {}).get("status") == "ok"
                                                          for r in range(world)):
        return LaunchResult(ok=True, rows=rows, info=info)

    errors = {r: res for r, res in results.items() if res.get("status") == "error"}
    causes = {r: e for r, e in errors.items() if not _is_connection_error(e["message"])}
    dead = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in results]
    if causes:
        # The root cause: an error that is not a lost connection; rank 0's first (agreed errors name the culprit).
        r = min(causes, key=lambda r: (r != 0, causes[r].get("time", 0)))
        e = causes[r]
        where = "" if r == 0 else f"rank {r}: "
        message = one_line(e["message"]) or e["type"]
        if e["type"] not in AGREED_TYPES:
            message = f"{e['type']}: {message}"
        if timed_out:
            message += f" (and rank(s) {running} were still running after {timeout:.0f} s)"
        return LaunchResult(ok=False, rows=rows, info=info, error=where + message, detail=e.get("traceback"))
    if dead:
        r = dead[0]
        return LaunchResult(ok=False, rows=rows, info=info,
                            error=f"rank {r} died (exit code {codes[r]}{_signal_name(codes[r])}) without a report",
                            detail=(f"last lines of rank {r}'s log:\n{_tail(logs[r])}" if _tail(logs[r]) else None))
    if running:
        tails = "\n".join(f"rank {r}:\n{_tail(logs[r], 8)}" for r in running[:2])
        if timed_out:
            error = (f"timed out after {timeout:.0f} s: rank(s) {running} did not finish (a hang, or a checkpoint "
                     "too big for the time: raise --timeout)")
        else:
            error = (f"rank(s) {running} hung: the other ranks timed out after {timeout:.0f} s waiting for them "
                     "(raise --timeout if they were only slow)")
        return LaunchResult(ok=False, rows=rows, info=info, error=error, detail=tails if debug else None)
    if errors:
        r = min(errors, key=lambda r: (r != 0, errors[r].get("time", 0)))
        e = errors[r]
        return LaunchResult(ok=False, rows=rows, info=info, detail=e.get("traceback"),
                            error=("" if r == 0 else f"rank {r}: ") + f"{e['type']}: {one_line(e['message'])}")
    return LaunchResult(ok=False, rows=rows, info=info, error=f"the ranks exited with codes {codes}")
