"""A sliding-window attention layer on a padded batch (issue 45 item 4): peak memory and time of its forward +
backward, parallm's path (the real tokens of each row through a piece plan: no [S, S] tensor) against the path it
replaced (SDPA over the padded [B, 1, S, S] mask and an [S, S] band built from int64 index differences, as
transformers' masks count the window), on the same input. Not part of the test suite.

    python bench/window_bench.py                      # S = 8k and 32k (the old path at 8k and 16k only: at 32k
                                                      # it needs ~8 GiB for its band alone), window 4096
    python bench/window_bench.py --seqs 8192 16384 32768 --old-max 32768     # the old path at 32k too
    python bench/window_bench.py --quick              # tiny shapes: checks the script runs, measures nothing

Each (path, S) runs in a fresh process (this script re-invoked with --one), started with glibc's
``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so that freed blocks go back to the system; the figure is the peak anonymous
RSS during one forward + backward (sampled every 2 ms) above the level before it, and the best of ``--iters``
wall times. Both paths take the same q / k / v (one layer's heads after the projections: batch 1, row 0 left-padded
by 1/8 of S, grouped-query heads) and give the same output at the real positions (checked at the smallest S).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import peak_and_best, table  # noqa: E402


def old_path(q, k, v, keep, window):
    """What parallm ran before: SDPA over the padded mask and an int64-built band (the code it replaced)."""
    import math

    import torch
    import torch.nn.functional as F

    from parallm.model.layers.attention import padded_attention_mask
    s = q.shape[2]
    i = torch.arange(s)
    rel = i[:, None] - i[None, :]
    band = (rel >= 0) & (rel < window)
    mask = padded_attention_mask(keep) & band
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
                                          enable_gqa=k.shape[1] != q.shape[1])


def new_path(q, k, v, keep, window):
    from parallm.model.layers.attention import PaddedRows, padded_attention
    return padded_attention(q, k, v, PaddedRows(keep), window=window)


def inputs(s, args):
    import torch
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, s, args.head_dim, generator=g)
    k, v = (torch.randn(1, args.kv_heads, s, args.head_dim, generator=g) for _ in range(2))
    keep = torch.ones(1, s, dtype=torch.bool)
    keep[0, :s // 8] = False
    return q, k, v, keep


def one(path: str, s: int, args) -> dict:
    import torch
    torch.set_num_threads(1)
    fn = {"old": old_path, "new": new_path}[path]
    q0, k0, v0, keep = inputs(s, args)
    grad = torch.randn(q0.shape, generator=torch.Generator().manual_seed(1)) * keep[:, None, :, None]

    def step():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = fn(q, k, v, keep, args.window)
        (out * grad).sum().backward()
        return out.detach()

    peak, best = peak_and_best(step, args.iters)
    return {"path": path, "s": s, "peak_mib": peak, "s_best": best}


def check_same(args) -> float:
    """max |old - new| at the real positions, at the smallest S."""
    import torch
    q, k, v, keep = inputs(min(args.seqs), args)
    with torch.no_grad():
        a = old_path(q, k, v, keep, args.window)
        b = new_path(q, k, v, keep, args.window)
    return float(((a - b) * keep[:, None, :, None]).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--old-max", type=int, default=16384, help="the old path runs at S up to this (default 16k)")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "S"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.window, args.heads, args.kv_heads, args.head_dim, args.iters = [256, 512], 64, 2, 1, 16, 1
        args.old_max = 512
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args)))
        return
    seqs = sorted(set(args.seqs) | ({s for s in (8192, 16384) if s <= args.old_max} if not args.quick else set()))
    runs = [(p, s) for s in seqs for p in ("new", "old") if p == "new" or s <= args.old_max]
    load = os.getloadavg()[0]
    rows, env = [], dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    passthrough = ["--window", str(args.window), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                   "--head-dim", str(args.head_dim), "--iters", str(args.iters)]
    for path, s in runs:
        out = subprocess.run([sys.executable, __file__, "--one", path, str(s)] + passthrough, env=env,
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by = {(r["path"], r["s"]): r for r in rows}
    print(f"load average before: {load:.2f}; window {args.window}, heads {args.heads}/{args.kv_heads}"
          f" x {args.head_dim}, batch 1 (1/8 left padding), fp32, one thread")
    print(f"max |old - new| at real positions, S = {min(seqs)}: {check_same(args):.2e}")
    table_rows = []
    for s in seqs:
        new, old = by[("new", s)], by.get(("old", s))
        table_rows.append([s, f"{new['peak_mib']:.0f}", f"{old['peak_mib']:.0f}" if old else "not run",
                           f"{new['peak_mib'] / old['peak_mib']:.3f}" if old else "-",
                           f"{new['s_best']:.3f}", f"{old['s_best']:.3f}" if old else "not run",
                           f"{new['s_best'] / old['s_best']:.2f}" if old else "-"])
    print(table(table_rows, ["S", "new peak MiB", "old peak MiB", "ratio", "new s", "old s", "time ratio"]))
    small, large = by[("new", seqs[0])], by[("new", seqs[-1])]
    print(f"new path: peak grows {large['peak_mib'] / max(small['peak_mib'], 1e-9):.2f}x for "
          f"{seqs[-1] / seqs[0]:.0f}x the tokens (linear: {seqs[-1] / seqs[0]:.0f}x)")


if __name__ == "__main__":
    main()
