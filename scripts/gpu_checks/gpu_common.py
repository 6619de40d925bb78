"""What the GPU checks under scripts/gpu_checks share: the process's place in the world, PASS / FAIL lines, and a
temporary directory every rank sees. Imported as ``from gpu_common import ...`` (a check's own folder is first on
``sys.path`` when it runs as a script; not named ``common``, which is bench/common.py on train.py's path)."""

from __future__ import annotations

import os
import tempfile

import torch


def start(cpu: bool, port: int) -> tuple[int, int, torch.device]:
    """``(world, rank, device)``: torchrun's environment, or a world of one at 127.0.0.1:``port``. On CUDA the
    local device is made current and TF32 is off (fp32 comparisons mean fp32); ``cpu``: the CPU (a dry run)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return world, rank, device


class Checks:
    """``checks(name, value, limit, ok=None)``: one PASS / FAIL line (printed on rank 0; ``ok`` defaults to
    ``value <= limit``); :meth:`finish` prints the summary and returns the exit status."""

    def __init__(self, rank: int):
        self.rank, self.failures = rank, []

    def __call__(self, name: str, value, limit, ok: bool | None = None) -> None:
        ok = (value <= limit) if ok is None else ok
        if not ok:
            self.failures.append(name)
        if self.rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} {name}: {value} (limit {limit})", flush=True)

    def finish(self, what: str) -> int:
        if self.rank == 0:
            print(f"all {what} checks passed" if not self.failures else f"FAILED: {self.failures}")
        return 1 if self.failures else 0


def shared_tmp(prefix: str) -> str:
    """A temporary directory made by rank 0, its path on every rank (collective)."""
    box = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
