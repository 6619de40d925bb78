"""Weight-sync export benchmark (``export_hf_tensors``). Not part of the test suite.

    python bench/export_bench.py [--size 383MB|1.5GB] [--bucket 64MB] [--reps 3] [--workdir DIR]

A Qwen2-shaped fp32 model (the checkpoint of bench/load_bench.py, built and loaded at tp2 x pp2 on 4 gloo ranks).
In the same processes, best of ``--reps`` each:

  reference   the same number of bytes broadcast from rank 0 to every rank in 64 MB messages
  all         ``export_hf_tensors(chunks, bucket_bytes=...)``: every rank receives every tensor
  dst=[0]     ``export_hf_tensors(chunks, bucket_bytes=..., dst_ranks=[0])``: rank 0 receives, the others send
  bf16        ``export_hf_tensors(chunks, dtype=torch.bfloat16, bucket_bytes=...)``: cast on the sender (reference:
              half the bytes)

Each time is the wall between two barriers (the consumer drops each tensor at once). Memory: the largest rise
of anonymous RSS during the first (warm-up) call, which allocates the buffers the stream keeps with the model,
on the worst destination and the worst non-destination rank; later calls reuse them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, rss_anon, run_world, table  # noqa: E402
from load_bench import SIZES, prepared_checkpoint  # noqa: E402


def rank_export(rank, world, ckpt, total, bucket, reps):
    import torch
    import torch.distributed as dist

    import parallm
    from parallm.checkpoint.saver import parse_size
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt, mode="slice")
    msg = 64 * 10 ** 6 // 4
    ref_buf = torch.empty(msg, dtype=torch.float32)

    def reference(nbytes):
        left = nbytes // 4
        while left > 0:
            n = min(left, msg)
            dist.broadcast(ref_buf[:n], src=0)
            left -= n

    def export(**kw):
        names = 0
        for _name, _t in parallm.export_hf_tensors(chunks, bucket_bytes=bucket, **kw):
            names += 1
        return names

    cases = {"reference": lambda: reference(total), "reference-half": lambda: reference(total // 2),
             "all": lambda: export(), "dst0": lambda: export(dst_ranks=[0]),
             "bf16": lambda: export(dtype=torch.bfloat16)}
    best, peak = {}, {}
    for i in range(reps + 2):      # round 0: each case's buffer footprint; round 1: warm; then timed
        for name, fn in cases.items():
            if i == 0:   # each case's first call allocates its own buffers: that is its footprint
                chunks[0].__dict__.pop("_parallm_export", None)
            base = rss_anon()
            dist.barrier()
            with PeakRss() as p:
                t = time.perf_counter()
                fn()
                dist.barrier()
                wall = time.perf_counter() - t
            if i >= 2:
                best[name] = min(best.get(name, wall), wall)
                peak[name] = max(peak.get(name, 0), p.peak - base)
            elif i == 0:   # the first call allocates the buffers the stream then keeps with the model
                peak[name + "/first"] = p.peak - base
    parallm.destroy_parallel()
    return dict(best=best, peak=peak, bucket=parse_size(bucket))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="383MB")
    ap.add_argument("--bucket", default="64MB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="parallm-export-bench-")
    try:
        ckpt, total = prepared_checkpoint(workdir, f"qwen2-fp32-{args.size}", SIZES[args.size], "float32",
                                          60 * 10 ** 6)
        res = run_world(rank_export, 4, ckpt, total, args.bucket, args.reps)
        t = {k: max(r["best"][k] for r in res) for k in res[0]["best"]}
        mib = 2 ** 20
        ref, half = t["reference"], t["reference-half"]
        dest_peak = {k: max(r["peak"][k] for r in res) for k in res[0]["peak"]}
        dst0_dest, dst0_other = res[0]["peak"]["dst0/first"], max(r["peak"]["dst0/first"] for r in res[1:])
        print(f"model: Qwen2-shaped fp32, {total / 1e6:.0f} MB; tp2 x pp2 on 4 gloo ranks ({os.cpu_count()} cores); "
              f"bucket {args.bucket}; best of {args.reps}")
        rows = [
            ("broadcast from rank 0, 64 MB messages (reference)", f"{ref:.3f} s", f"{total / ref / 1e9:.2f}", "1.00",
             "-"),
            ("export to every rank", f"{t['all']:.3f} s", f"{total / t['all'] / 1e9:.2f}", f"{t['all'] / ref:.2f}",
             f"{dest_peak['all/first'] / mib:.0f} MiB"),
            ("export dst_ranks=[0] (rank 0 / senders)", f"{t['dst0']:.3f} s", f"{total / t['dst0'] / 1e9:.2f}",
             f"{t['dst0'] / ref:.2f}", f"{dst0_dest / mib:.0f} / {dst0_other / mib:.0f} MiB"),
            ("export to every rank, dtype=bf16 (ref: half the bytes)", f"{t['bf16']:.3f} s",
             f"{total / 2 / t['bf16'] / 1e9:.2f}", f"{t['bf16'] / half:.2f}",
             f"{dest_peak['bf16/first'] / mib:.0f} MiB"),
        ]
        print(table(rows, ["", "time", "GB/s", "/ reference", "buffers (first call's peak extra anon)"]))
        later = max(v for r in res for k, v in r["peak"].items() if not k.endswith("/first") and k[0] != "r")
        print(f"later calls (buffers kept with the model): peak extra anon at most {later / mib:.0f} MiB on any rank")
        print(f"export / reference = {t['all'] / ref:.2f}  (goal <= 1.5, aim 1.0); bucket = "
              f"{res[0]['bucket'] / mib:.0f} MiB")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
