"""Nemotron-3 training step (issue 49): parallm against transformers, and the Mamba-2 SSD scan's share. Not part of
the test suite.

    python bench/nemotron_bench.py               # a Nemotron-3-Nano-shaped model: hidden 1024, 12 layers in the
                                                 # published pattern's proportions (MEMEM*EMEMEM: 6 Mamba-2, 5 MoE,
                                                 # 1 attention), 32 relu2 experts top-4, batch 2 x 1024, fp32
    python bench/nemotron_bench.py --quick       # a tiny shape: checks that the script runs, measures nothing

One process (tp = pp = ep = 1, gloo world of 1), fp32, the same model on both sides (transformers runs its
pure-torch Mamba-2 path: no mamba-ssm here): parallm.forward_backward against transformers' forward + loss +
backward, timed in interleaved rounds (best round, wall and process CPU time), each side's peak anonymous RSS
during a step above its level before it (in a second process started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at
1 MiB), and the scan's share of parallm's step: 1 - (the step with the SSD scan replaced by a trivial stand-in)
/ (the step). Target (issue 49): step time <= 1.0x transformers, aim 0.7x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import one_process_pair, PeakRss, free_port, rss_anon, table  # noqa: E402
from compute_bench import ce_loss  # noqa: E402
from moe_bench import interleaved  # noqa: E402

NANO_PATTERN = "MEMEM*EMEMEM"     # 12 layers: Nemotron-3-Nano's 23 M / 23 E / 6 * in proportion


def make_config(args):
    import transformers
    head = 128 if args.hidden >= 512 else 32
    return transformers.AutoConfig.for_model(
        "nemotron_h", hybrid_override_pattern=args.pattern, hidden_size=args.hidden,
        num_attention_heads=args.hidden // head, num_key_value_heads=2, head_dim=head,
        mamba_num_heads=2 * args.hidden // 64, mamba_head_dim=64, n_groups=8 if args.hidden >= 512 else 2,
        ssm_state_size=128 if args.hidden >= 512 else 16, conv_kernel=4, chunk_size=args.chunk,
        intermediate_size=2 * args.hidden, n_routed_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width, moe_shared_expert_intermediate_size=2 * args.expert_width,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, vocab_size=8000, max_position_embeddings=4 * args.seq,
        attn_implementation="sdpa")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--pattern", default=NANO_PATTERN)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=384)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny shape (hidden 128, MEM*E, 8 experts, 2 x 80)")
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)   # the memory run (see below)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.pattern, args.experts, args.top_k, args.expert_width = 128, "MEM*E", 8, 2, 64
        args.seq, args.batch, args.iters, args.chunk = 80, 2, 1, 32
    load_before = os.getloadavg()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch
    import transformers

    import parallm
    from parallm.model.layers import mamba2
    cfg = make_config(args)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    b, s = args.batch, args.seq
    chunks, hf_step, pl_step, _ = one_process_pair(hf, batch=b, seq=s, loss=ce_loss,
                                                   prefix="parallm-nemotronbench-")
    real_scan = mamba2.ssd_scan

    def stand_in(x, dt, a, b_, c, *, chunk, d=None, reset=None, **_):   # keeps the graph, does next to no work
        return x.float() * dt.float().unsqueeze(-1)

    def pl_step_without_scan():
        mamba2.ssd_scan = stand_in
        try:
            pl_step()
        finally:
            mamba2.ssd_scan = real_scan

    if args.memory_only:
        hf_step()               # each side's gradients exist before its measured step, as in the timed rounds
        pl_step()
        peaks = {}
        for name, fn in (("transformers", hf_step), ("parallm", pl_step)):
            before = rss_anon()
            with PeakRss() as peak:
                fn()
            peaks[name] = peak.peak - before
        print("PEAKS " + json.dumps(peaks))
        parallm.destroy_parallel()
        return
    (t_pl, t_hf, t_stub), (c_pl, c_hf, c_stub) = interleaved([pl_step, hf_step, pl_step_without_scan], args.iters)
    cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--memory-only"]
    run = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), capture_output=True,
                         text=True, check=True)
    peaks = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("PEAKS "))[6:])
    rows = []
    for what, pl, ref, stub in (("wall", t_pl, t_hf, t_stub), ("CPU time", c_pl, c_hf, c_stub)):
        rows.append((f"step {what}: parallm / transformers", f"{pl:.3f} s / {ref:.3f} s", f"{pl / ref:.2f}",
                     "<= 1.0 (aim 0.7)"))
        rows.append((f"SSD scan share of parallm's step ({what})", f"{pl - stub:.3f} s of {pl:.3f} s",
                     f"{1 - stub / pl:.2f}", "report"))
    rows.append(("step peak RSS above start: parallm / transformers",
                 f"{peaks['parallm'] / 2**20:.0f} MiB / {peaks['transformers'] / 2**20:.0f} MiB",
                 f"{peaks['parallm'] / max(peaks['transformers'], 1):.2f}", "report"))
    print(f"model: Nemotron-3 hidden {args.hidden}, pattern {args.pattern}, {args.experts} experts top-{args.top_k} "
          f"of width {args.expert_width}, chunk {args.chunk}; batch {b} x {s}; fp32, {torch.get_num_threads()} "
          f"threads; Mamba-2 kernel {chunks[0].mamba_kernel}" + ("  (--quick: not a measurement)"
                                                                 if args.quick else ""))
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}"
          + ("" if max(load_before[0], load_after[0]) < 2 else "  -- PROVISIONAL: machine not quiet"))
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
