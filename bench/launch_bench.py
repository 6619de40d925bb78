"""Start-up of a local world: parallm.verify.spawn against torch's elastic_launch. Not part of the test suite.

    python bench/launch_bench.py [--world 4] [--launches 3]

Each launcher runs in a fresh process (its own forkserver) and starts ``--launches`` worlds one after the other;
every rank joins the default process group and all-reduces one number. Both fork their ranks from a forkserver
that imports the same modules once (torch, transformers, megatron-core, parallm). Reported: the wall time of the
first world (includes starting that forkserver) and the best of the later ones, and elastic_launch / spawn as a
ratio measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import table  # noqa: E402


def rank_fn(rank, world):
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():        # elastic_launch: the environment says where to meet
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def elastic_fn():
    import torch.distributed as dist
    return rank_fn(dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"]), 0)


def measure(launcher: str, world: int, launches: int) -> list[float]:
    times = []
    for i in range(launches):
        t = time.perf_counter()
        if launcher == "spawn":
            from parallm.verify import spawn
            out = spawn(rank_fn, world, timeout=600)
        else:  # the same forkserver preload as spawn's: what differs is the launcher itself
            import multiprocessing

            from parallm.verify.launch import PRELOAD
            from torch.distributed.launcher.api import LaunchConfig, elastic_launch
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
            cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, rdzv_backend="c10d",
                               rdzv_endpoint="localhost:0", run_id=f"bench{i}", max_restarts=0,
                               start_method="forkserver", monitor_interval=0.1)
            out = list(elastic_launch(cfg, elastic_fn)().values())
        times.append(time.perf_counter() - t)
        assert out == [world] * world, out
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--only", choices=("spawn", "elastic"), help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args.world, args.launches)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    res = {}
    for launcher in ("spawn", "elastic"):
        out = subprocess.run([sys.executable, __file__, "--only", launcher, "--world", str(args.world),
                              "--launches", str(args.launches)], env=env, capture_output=True, text=True,
                             check=True)
        res[launcher] = json.loads(out.stdout.strip().splitlines()[-1])
    s, e = res["spawn"], res["elastic"]
    rows = [("first world (starts the forkserver)", f"{s[0]:.2f} s", f"{e[0]:.2f} s", f"{e[0] / s[0]:.2f}"),
            (f"best of the next {len(s) - 1}", f"{min(s[1:]):.2f} s", f"{min(e[1:]):.2f} s",
             f"{min(e[1:]) / min(s[1:]):.2f}")]
    print(f"{args.world} gloo ranks, init + one all_reduce; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(table(rows, ["launch", "parallm.verify.spawn", "elastic_launch", "elastic / spawn"]))


if __name__ == "__main__":
    main()
