"""What every rank runs: a job is a list of layout checks that share one process group.

A job is a JSON-able dict (the launcher writes it to a file for spawned ranks; under torchrun each rank builds
the same dict from the command line):

    kind        "demo" | "verify"
    cases       verify: [case]; demo: computed on the ranks from the world size (``demo.demo_cases``)
    quick       demo: run the quick subset
    workdir     where demo checkpoints and saved directories go; None: rank 0 makes a temporary one
    batch, seq, seed, lr (None: auto), atol, weights_atol, timeout, backend (None: parallm's default)

Between layouts only Megatron's groups change (``init_parallel`` again with the next tp / pp / vpp); the
world and its default group stay, so the ranks' start-up cost (imports, rendezvous) is paid once.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch.distributed as dist

from .checks import layout_name, run_case
from .common import slug


def run_job(job: dict, rows: list, progress) -> dict:
    """Run the job's cases on this rank, appending rank 0's result rows to ``rows``. Returns
    ``{"skipped": [...], "workdir": path, "temporary": bool}``. Every rank calls it."""
    import parallm
    from ..parallel.errors import run_local

    parallm.init_parallel(tp=1, pp=1, backend=job.get("backend"), timeout_s=job["timeout"])
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir, temporary = job.get("workdir"), False
    if workdir is None:
        box = [run_local(lambda: tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-") if rank == 0 else None,
                         what="making a work directory")]
        dist.broadcast_object_list(box, src=0)
        workdir, temporary = box[0], True
    info = {"skipped": [], "workdir": workdir, "temporary": temporary, "world": world,
            "backend": dist.get_backend()}
    try:
        if job["kind"] == "demo":
            from .demo import demo_cases, make_checkpoints
            cases, info["skipped"] = demo_cases(workdir, quick=job.get("quick", False), world=world)
            if not cases:
                raise ValueError(f"no demo layout fits a world of {world} rank(s) (they need 2 or 4)")
            progress(f"{world} ranks up ({dist.get_backend()}); making {len({c['ckpt'] for c in cases})} tiny "
                     f"checkpoints with transformers in {workdir}")
            run_local(lambda: make_checkpoints(cases) if rank == 0 else None, what="making the demo checkpoints")
        else:
            cases = job["cases"]
            for case in cases:
                need = case["tp"] * case["pp"] * (case.get("dp") or 1)
                if case.get("dp") and world != need:
                    raise ValueError(f"the world has {world} rank(s), not tp={case['tp']} x pp={case['pp']} x "
                                     f"dp={case['dp']} = {need}")
                if world % need:
                    raise ValueError(f"the world has {world} rank(s): tp={case['tp']} x pp={case['pp']} = {need} "
                                     "does not divide it")
            progress(f"{world} ranks up ({dist.get_backend()})")
        for case in cases:
            if not case.get("save_dir"):
                case["save_dir"] = os.path.join(workdir, "saved", slug(f"{layout_name(case)} {case['model']}"))
            row = run_case(case, job, progress)
            if rank == 0:
                rows.append(row)
    finally:
        if temporary and rank == 0 and not job.get("keep"):
            shutil.rmtree(workdir, ignore_errors=True)
    return info
