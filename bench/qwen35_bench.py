"""Qwen3.5-MoE training step (issue 38): parallm against transformers, and the Gated DeltaNet recurrence's share.
Not part of the test suite.

    python bench/qwen35_bench.py                 # hidden 1024, 8 layers (6 Gated DeltaNet + 2 attention), 64 experts
                                                 # top-8, batch 2 x 512, fp32
    python bench/qwen35_bench.py --quick         # a tiny shape: checks that the script runs, measures nothing

One process (tp = pp = ep = 1, gloo world of 1), fp32, the same Qwen3.5-MoE model on both sides (transformers
runs its pure-torch recurrence: no fla here): parallm.forward_backward against transformers' forward + loss +
backward, timed in interleaved rounds (best round, wall and process CPU time), each side's peak anonymous RSS
during a step above its level before it (sampled every 2 ms, in a second process started with glibc's
``MALLOC_MMAP_THRESHOLD_`` at 1 MiB, so that memory a step frees goes back to the system), and the recurrence's
share of parallm's step: 1 - (the step with the chunked gated delta rule replaced by a trivial stand-in) / (the step). Target (issue 38):
step time <= 1.0x transformers, aim 0.7x.
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny shape (hidden 128, 4 layers, 8 experts, 2 x 80)")
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)   # the memory run (see below)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.experts, args.top_k, args.expert_width = 128, 4, 8, 2, 64
        args.seq, args.batch, args.iters = 80, 2, 1
    load_before = os.getloadavg()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch
    import transformers

    import parallm
    from parallm.model.layers import gated_deltanet as gdn
    head = 128 if args.hidden >= 512 else 32
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_moe_text", hidden_size=args.hidden, num_hidden_layers=args.layers, full_attention_interval=4,
        num_attention_heads=args.hidden // head, num_key_value_heads=2, head_dim=head,
        linear_num_key_heads=args.hidden // head, linear_num_value_heads=2 * args.hidden // head,
        linear_key_head_dim=head, linear_value_head_dim=head, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        shared_expert_intermediate_size=2 * args.expert_width, vocab_size=8000, max_position_embeddings=4 * args.seq,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    b, s = args.batch, args.seq
    chunks, hf_step, pl_step, _ = one_process_pair(hf, batch=b, seq=s, loss=ce_loss,
                                                   prefix="parallm-qwen35bench-")

    real_rule = gdn.chunk_gated_delta_rule

    def stand_in(q, k, v, g, beta, **kw):     # keeps the graph, does next to no work
        return v.float() * beta.unsqueeze(-1).float()

    def pl_step_without_recurrence():
        gdn.chunk_gated_delta_rule = stand_in
        try:
            pl_step()
        finally:
            gdn.chunk_gated_delta_rule = real_rule

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
    (t_pl, t_hf, t_stub), (c_pl, c_hf, c_stub) = interleaved([pl_step, hf_step, pl_step_without_recurrence],
                                                             args.iters)
    # Peak memory in a process of its own, started with glibc's MALLOC_MMAP_THRESHOLD_ at 1 MiB: without it glibc
    # keeps freed heap memory mapped, and the side measured second fits in what the first one freed (it showed
    # 0 MiB). The timed rounds above run without it: an mmap per large block slows both sides' steps.
    cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--memory-only"]
    run = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), capture_output=True,
                         text=True, check=True)
    peaks = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("PEAKS "))[6:])
    rows = []
    for what, pl, ref, stub in (("wall", t_pl, t_hf, t_stub), ("CPU time", c_pl, c_hf, c_stub)):
        rows.append((f"step {what}: parallm / transformers", f"{pl:.3f} s / {ref:.3f} s", f"{pl / ref:.2f}",
                     "<= 1.0 (aim 0.7)"))
        rows.append((f"recurrence share of parallm's step ({what})", f"{pl - stub:.3f} s of {pl:.3f} s",
                     f"{1 - stub / pl:.2f}", "report"))
    rows.append(("step peak RSS above start: parallm / transformers",
                 f"{peaks['parallm'] / 2**20:.0f} MiB / {peaks['transformers'] / 2**20:.0f} MiB",
                 f"{peaks['parallm'] / max(peaks['transformers'], 1):.2f}", "report"))
    linear = sum(t == "linear_attention" for t in cfg.layer_types)
    print(f"model: Qwen3.5-MoE hidden {args.hidden}, {args.layers} layers ({linear} Gated DeltaNet), {args.experts} "
          f"experts top-{args.top_k} of width {args.expert_width}; batch {b} x {s}; fp32, {torch.get_num_threads()} "
          f"threads; Gated DeltaNet kernel {chunks[0].gdn_kernel}" + ("  (--quick: not a measurement)"
                                                                      if args.quick else ""))
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}"
          + ("" if max(load_before[0], load_after[0]) < 2 else "  -- PROVISIONAL: machine not quiet"))
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
