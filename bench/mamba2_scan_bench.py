"""Mamba-2's torch SSD scan (issue 55, item 5): peak memory of one forward + backward of
``parallm.model.layers.mamba2.ssd_scan`` at S and 4 S tokens; the chunk-to-chunk scan is linear in S (target: x4
tokens -> <= x4.5 memory). Not part of the test suite.

    python bench/mamba2_scan_bench.py                       # 4k and 16k tokens, 128 heads of 64, state 128,
                                                            # 8 groups, chunk 256, fp32, one packed row of 4
                                                            # documents (the resets cut the state)
    python bench/mamba2_scan_bench.py --device cuda         # the same on a GPU (torch.cuda.max_memory_allocated)
    python bench/mamba2_scan_bench.py --quick               # a tiny shape: checks that the script runs

CPU: each length runs in its own process (glibc ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so freed blocks go back), the
peak anonymous RSS during the step above its level before it. CUDA: the peak allocated above the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, rss_anon, table  # noqa: E402


def one(args, length: int) -> int:
    """Peak bytes of one forward + backward of the scan at ``length`` tokens."""
    import torch
    import torch.nn.functional as F

    from parallm.model.layers import mamba2
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    h, p, n, grp = args.heads, args.head_dim, args.state, args.groups

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_()
    x, dt_raw, b, c = rand(1, length, h, p), rand(1, length, h), rand(1, length, grp, n), rand(1, length, grp, n)
    a = -torch.rand(h, generator=g).to(dev) - 0.1
    chunks = -(-length // args.chunk)
    reset = torch.zeros(chunks, dtype=torch.bool, device=dev)
    reset[::max(1, chunks // 4)] = True                # four documents, each starting on a chunk
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_anon()
    with PeakRss() as peak:
        y = mamba2.ssd_scan(x, F.softplus(dt_raw), a, b, c, chunk=args.chunk, reset=reset)
        y.square().sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return peak.peak - base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="S (the second point is 4 S)")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny shape (256 / 1024 tokens, 4 heads): runs only")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)     # the per-length process
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.heads, args.head_dim, args.state, args.groups, args.chunk = 256, 4, 8, 16, 2, 32
    if args.one is not None:
        print("PEAK " + json.dumps(one(args, args.one)))
        return
    peaks = {}
    for length in (args.tokens, 4 * args.tokens):
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--one", str(length)]
        run = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), capture_output=True,
                             text=True, check=True)
        peaks[length] = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("PEAK "))[5:])
    s, s4 = args.tokens, 4 * args.tokens
    rows = [(f"peak at {s} tokens", f"{peaks[s] / 2**20:.0f} MiB", "", ""),
            (f"peak at {s4} tokens", f"{peaks[s4] / 2**20:.0f} MiB", f"{peaks[s4] / max(peaks[s], 1):.2f}",
             "<= 4.5 (linear in S)")]
    print(f"Mamba-2 torch SSD scan, forward + backward: {args.heads} heads of {args.head_dim}, state {args.state}, "
          f"{args.groups} groups, chunk {args.chunk}, fp32, {args.device}"
          + ("  (--quick: not a measurement)" if args.quick else ""))
    print(table(rows, ["metric", "measured", "ratio x4 tokens", "target"]))


if __name__ == "__main__":
    main()
