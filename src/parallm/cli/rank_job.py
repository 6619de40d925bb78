"""What every rank runs for ``demo`` and ``verify``: a job's layout checks in one process group (started by
:func:`parallm.verify.spawn`, or in place under torchrun)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time


def _test_fault(rank: int) -> None:
    """Test hook: PARALLM_CLI_FAULT=die:R / hang:R makes rank R exit abruptly / never finish (tests/test_cli.py
    checks that the command reports it and never waits forever)."""
    kind, _, target = os.environ.get("PARALLM_CLI_FAULT", "").partition(":")
    if target == str(rank) and kind == "die":
        os._exit(3)
    while target == str(rank) and kind == "hang":
        time.sleep(3600)


def rank_job(rank: int, world: int, job: dict) -> dict | None:
    """Every rank: the job's layout checks in one process group (only Megatron's groups change between layouts,
    so the start-up is paid once). Rank 0 returns ``{"rows": [...], "info": {...}}``, the others None.

    job: ``kind`` "demo" | "verify" (names the work directory); the checks: ``checks`` (a list of
    :class:`parallm.verify.Check`), or ``prepare``, a module-level function ``prepare(job, workdir, world,
    progress) -> (checks, skipped notes)`` run on every rank (the demo's, which makes its checkpoints); ``workdir``
    (None: rank 0 makes a temporary one, removed at the end unless ``keep``); ``backend``; ``timeout``;
    ``progress``: a file rank 0 appends progress lines to (None: stderr, unless ``quiet``); ``check``:
    :class:`Check` fields."""
    import dataclasses

    import torch.distributed as dist

    import parallm
    from ..parallel.errors import run_local
    from ..parallel.megatron_import import ignore_library_warnings
    from ..verify import check_layout
    ignore_library_warnings()
    parallm.init_parallel(tp=1, backend=job["backend"], timeout_s=job["timeout"])
    rank, world = dist.get_rank(), dist.get_world_size()
    _test_fault(rank)

    def progress(msg: str) -> None:
        if rank == 0 and job["progress"]:
            with open(job["progress"], "a") as f:
                f.write(msg + "\n")
        elif rank == 0 and not job["quiet"]:
            print(msg, file=sys.stderr, flush=True)

    workdir, temporary = job["workdir"], job["workdir"] is None
    if temporary:
        made = [run_local(lambda: tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-") if rank == 0 else None,
                          what="making a work directory")]
        dist.broadcast_object_list(made, src=0)
        workdir = made[0]
    info = dict(world=world, backend=dist.get_backend(), workdir=workdir, temporary=temporary, skipped=[])
    rows = []
    try:
        if job.get("prepare"):
            checks, info["skipped"] = job["prepare"](job, workdir, world, progress)
        else:
            checks = job["checks"]
            progress(f"{world} ranks up ({dist.get_backend()})")
        for c in checks:
            if not c.save_dir:
                slug = "-".join(f"{c.name(world // (c.tp * c.pp))} {c.label}".replace(",", "").split())
                c = dataclasses.replace(c, save_dir=os.path.join(workdir, "saved", slug))
            rows.append(check_layout(c, progress=progress))
    finally:
        if temporary and rank == 0 and not job.get("keep"):
            shutil.rmtree(workdir, ignore_errors=True)
    return dict(rows=rows, info=info) if rank == 0 else None
