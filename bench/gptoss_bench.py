"""gpt-oss training step (issue 48): parallm against transformers on the same batch. Not part of the test suite.

    python bench/gptoss_bench.py                 # hidden 1024, 8 layers (window 128 on every other one, sinks,
                                                 # YaRN), 32 experts top-4 of width 1024, batch 2 x 1024, fp32
    python bench/gptoss_bench.py --quick         # a tiny shape: checks that the script runs, measures nothing

One process (tp = pp = ep = 1, gloo world of 1), fp32, the same gpt-oss model on both sides: parallm.forward_backward
against transformers' forward + loss + backward (its default implementations on CPU: eager attention, the only
one gpt-oss has there besides flex, and its grouped-GEMM experts), timed in interleaved rounds (best round, wall
and process CPU time), and each side's peak anonymous RSS during a step above its level before it (sampled every
2 ms, in a second process started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB, so that memory a step frees
goes back to the system). Target (issue 48): step time <= 1.0x transformers, aim 0.7x.
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


def gpt_oss_config(args):
    import transformers
    head = 64
    return transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // head,
        num_key_value_heads=max(1, args.hidden // head // 4), head_dim=head, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, intermediate_size=args.expert_width, sliding_window=args.window,
        vocab_size=8000, max_position_embeddings=max(4096, 4 * args.seq),
        rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=4096, rope_theta=150000.0),
        attn_implementation="eager")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny shape (hidden 128, 2 layers, 8 experts, 2 x 80)")
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)   # the memory run (see below)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.experts, args.top_k, args.expert_width = 128, 2, 8, 2, 64
        args.window, args.seq, args.batch, args.iters = 16, 80, 2, 1
    load_before = os.getloadavg()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch
    import transformers

    import parallm
    cfg = gpt_oss_config(args)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    b, s = args.batch, args.seq
    chunks, hf_step, pl_step, _ = one_process_pair(hf, batch=b, seq=s, loss=ce_loss, prefix="parallm-gptossbench-")

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
    (t_pl, t_hf), (c_pl, c_hf) = interleaved([pl_step, hf_step], args.iters)
    # Peak memory in a process of its own (see bench/qwen35_bench.py: glibc keeps freed heap memory mapped
    # otherwise, and the side measured second fits in what the first one freed).
    cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--memory-only"]
    run = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), capture_output=True,
                         text=True, check=True)
    peaks = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("PEAKS "))[6:])
    rows = []
    for what, pl, ref in (("wall", t_pl, t_hf), ("CPU time", c_pl, c_hf)):
        rows.append((f"step {what}: parallm / transformers", f"{pl:.3f} s / {ref:.3f} s", f"{pl / ref:.2f}",
                     "<= 1.0 (aim 0.7)"))
    rows.append(("step peak RSS above start: parallm / transformers",
                 f"{peaks['parallm'] / 2**20:.0f} MiB / {peaks['transformers'] / 2**20:.0f} MiB",
                 f"{peaks['parallm'] / max(peaks['transformers'], 1):.2f}", "report"))
    from parallm.model.layers.moe import expert_kernel_of
    print(f"model: gpt-oss hidden {args.hidden}, {args.layers} layers (window {args.window} on the even ones, "
          f"sinks, YaRN), {args.experts} experts top-{args.top_k} of width {args.expert_width}; batch {b} x {s}; "
          f"fp32, {torch.get_num_threads()} threads; parallm attention {chunks[0].attn_impl}, experts "
          f"{expert_kernel_of(chunks)}; transformers experts {hf.config._experts_implementation}"
          + ("  (--quick: not a measurement)" if args.quick else ""))
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}"
          + ("" if max(load_before[0], load_after[0]) < 2 else "  -- PROVISIONAL: machine not quiet"))
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
