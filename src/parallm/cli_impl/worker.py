"""A rank started by ``parallm demo`` / ``parallm verify`` (standalone launch).

The launcher forks ranks from a forkserver that imported torch, megatron-core, parallm and transformers once
(:mod:`parallm.cli_impl.preload`), so a rank starts in well under a second instead of paying the imports again;
:func:`run_rank` is the process target. ``python -m parallm.cli_impl.worker JOB.json RESULT_DIR`` runs the same
code in a fresh interpreter (RANK / WORLD_SIZE / LOCAL_RANK from the environment). The rank joins the others
through a ``file://`` rendezvous in the launcher's temporary directory (no port to find), runs the job, and writes
``RESULT_DIR/rank-<r>.json``: ``{"status": "ok", "rows": [...], "info": {...}}`` or ``{"status": "error",
"type": ..., "message": ..., "traceback": ..., "rows": [rows finished before the error]}``. Rank 0 appends progress
lines to ``RESULT_DIR/progress.txt``, which the launcher prints as they come.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the launcher dies (so no orphan ever waits in a collective)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux)
        pass


def _test_fault(rank: int) -> None:
    """Test hook: PARALLM_CLI_FAULT=die:R / hang:R makes rank R exit abruptly / never finish (tests/test_cli.py
    checks that the launcher reports it and never waits forever)."""
    fault = os.environ.get("PARALLM_CLI_FAULT", "")
    kind, _, target = fault.partition(":")
    if not fault or target != str(rank):
        return
    if kind == "die":
        os._exit(3)
    if kind == "hang":
        while True:
            time.sleep(3600)


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


def run_rank(rank: int, world: int, job_path: str, result_dir: str, env: dict, log_path: str) -> None:
    """Process target: set the rank's environment, send its output to ``log_path``, run :func:`main`."""
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main([job_path, result_dir])


def main(argv: list[str]) -> int:
    job_path, result_dir = argv
    _die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(job_path) as f:
        job = json.load(f)
    import faulthandler
    # Last resort: a rank still alive well past the launcher's deadline prints where it is stuck and exits.
    faulthandler.dump_traceback_later(job["timeout"] + 60, exit=True)
    import torch
    torch.set_num_threads(1)
    from .job import run_job

    def progress(msg: str) -> None:
        if rank == 0:
            with open(os.path.join(result_dir, "progress.txt"), "a") as f:
                f.write(msg + "\n")

    rows: list = []
    result_path = os.path.join(result_dir, f"rank-{rank}.json")
    code = 0
    try:
        from datetime import timedelta

        import torch.distributed as dist
        backend = job.get("backend") or "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, init_method=f"file://{job['rendezvous']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=job["timeout"]))
        _test_fault(rank)
        info = run_job(job, rows, progress)
        write_json(result_path, {"status": "ok", "rows": rows, "info": info})
        import parallm
        parallm.destroy_parallel()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which prints one line
        code = 1
        traceback.print_exc()
        write_json(result_path, {"status": "error", "type": type(e).__name__, "message": str(e),
                                 "traceback": traceback.format_exc(), "rows": rows, "time": time.time()})
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after a failed collective, process-group destructors can block.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
