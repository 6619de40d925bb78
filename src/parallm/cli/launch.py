"""Running a ``demo`` / ``verify`` job: standalone on local ranks (:func:`parallm.verify.spawn`), or in place on
every rank of a torchrun world; rank 0 prints the report. No torch import at module level: ``--help`` stays
fast."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from ..errors import USER_ERRORS
from .errors import EXIT_FAIL, EXIT_OK, UsageError, err, one_line
from .rank_job import rank_job
from .report import report


def under_torchrun() -> bool:
    """True when a launcher (torchrun, or anything that sets RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_job(args, job: dict, *, world: int, title: str, header: str | None = None) -> int:
    """Standalone: start ``world`` local ranks; under torchrun: run in place. Prints the report (rank 0)."""
    job.update(timeout=args.timeout, quiet=args.quiet, progress=None)
    if under_torchrun():
        return _run_torchrun(args, job, title=title + " (torchrun)", header=header)
    from ..verify import SpawnError, spawn
    job["backend"] = _choose_backend(args.device, world)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-")
    job["progress"] = os.path.join(tmp, "progress.txt")
    if job["workdir"] is None:
        job["workdir"] = tmp
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    show = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    show(f"{title}: starting {world} local rank(s) ({job['backend']})")
    env = dict(HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false",
               PARALLM_PROGRESS="0", PARALLM_TIMEOUT_S=str(args.timeout))
    if job["backend"] == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""   # CPU ranks: keep the CUDA code paths out entirely
    result, error = dict(rows=[], info={}), None
    try:
        result = spawn(rank_job, world, job, timeout=args.timeout, backend=job["backend"], env=env, log_dir=logs,
                       on_poll=_tail(job["progress"], show))[0]
    except SpawnError as e:
        error = e.summary
        detail = e.culprit.traceback or e.culprit.log
        if detail and (args.debug or e.culprit.status == "dead"):
            print(detail, file=sys.stderr)
    finally:
        if args.debug or getattr(args, "keep", False):
            print(f"(kept {tmp}; the ranks' logs are in {logs})", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return report(args, result["rows"], error=error, info=result["info"], title=title, header=header,
                  elapsed=time.perf_counter() - t0)


def _tail(path: str, show):
    """A poll function: shows the lines rank 0 appended to ``path`` since the last call (a partial line waits)."""
    seen, t0 = [0], time.monotonic()

    def poll() -> None:
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().splitlines(keepends=True)
            lines = [ln.rstrip("\n") for ln in lines if ln.endswith("\n")]
            for line in lines[seen[0]:]:
                show(f"[{time.monotonic() - t0:5.1f}s] {line}")
            seen[0] = len(lines)
    return poll


def _choose_backend(device: str, ranks: int) -> str:
    """gloo (CPU) or nccl (one GPU per local rank)."""
    if device == "cpu":
        return "gloo"
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and n < ranks:
        raise UsageError(f"--device cuda needs one GPU per rank: {ranks} rank(s), {n} GPU(s) visible")
    return "nccl" if n >= ranks else "gloo"


def _run_torchrun(args, job: dict, *, title: str, header: str | None) -> int:
    """Every rank of torchrun's world runs the job in place; rank 0 prints; all ranks exit with rank 0's code."""
    import torch.distributed as dist
    rank, t0 = int(os.environ["RANK"]), time.perf_counter()
    job["backend"] = None if args.device == "auto" else ("nccl" if args.device == "cuda" else "gloo")
    result, error = dict(rows=[], info={}), None
    try:
        result = rank_job(rank, int(os.environ["WORLD_SIZE"]), job) or result
    except Exception as e:  # noqa: BLE001 - one line; the others learn it from agree() or from torchrun
        mine = type(e).__name__ in USER_ERRORS  # parallm's own errors: the same message on every rank
        error = one_line(e) if mine else f"{type(e).__name__}: {one_line(e)}"
        if rank != 0 and (args.debug or not mine):
            err(f"[rank {rank}] {error}")
        if args.debug:
            import traceback
            traceback.print_exc()
    code = EXIT_FAIL
    if error is None:
        passed = [bool(result["rows"]) and all(r["ok"] for r in result["rows"])]   # rank 0's verdict
        dist.broadcast_object_list(passed, src=0)
        code = EXIT_OK if passed[0] else EXIT_FAIL
    if rank == 0:
        code = report(args, result["rows"], error=error, info=result["info"], title=title, header=header,
                      elapsed=time.perf_counter() - t0)
        if result["info"].get("temporary") and job.get("keep"):
            print(f"(kept {result['info']['workdir']})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None:
        os._exit(code)  # peers may be gone: skip process-group teardown
    import parallm
    parallm.destroy_parallel()
    return code
