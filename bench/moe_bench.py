"""Mixture-of-experts training-step throughput. Not part of the test suite.

    python bench/moe_bench.py [--layers 4] [--hidden 512] [--experts 8] [--top-k 2] [--expert-width 512]
                              [--seq 256] [--batch 8] [--iters 3]
    python bench/moe_bench.py --issue26     # 2 layers, 64 experts top-8, 192 wide (a Qwen3-MoE-shaped step)

One process (tp = pp = ep = 1, gloo world of 1), fp32, both sides in the same process and run, same Qwen3-MoE
model (every layer routed): parallm.forward_backward against transformers' forward + loss + backward, with
transformers' default experts implementation (``grouped_mm``) and with its per-expert loop (``eager``), and
parallm with its experts' loop kernel as well as the one it chose. The four are timed in interleaved rounds;
each figure is the best round, by wall time and by this process's CPU time (user + system: on this VM fresh
memory costs page faults, so allocations count). Also: parameter tensors per MoE layer, the expert kernel, and
the load average before and after (figures taken with it above 2 are provisional).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import one_process_pair, free_port, table  # noqa: E402
from compute_bench import ce_loss  # noqa: E402


def interleaved(fns, rounds):
    """Best wall time and best process CPU time of each function over ``rounds`` rounds that run every function
    once, after one warm-up each. CPU time (all threads of this process) is the work done, much less sensitive
    than wall time to other processes competing for the cores."""
    import time
    for fn in fns:
        fn()
    wall, cpu = [float("inf")] * len(fns), [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[i] = min(wall[i], time.perf_counter() - t)
            cpu[i] = min(cpu[i], time.process_time() - c)
    return wall, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--issue26", action="store_true",
                    help="issue 26's shape: --layers 2 --experts 64 --top-k 8 --expert-width 192")
    args = ap.parse_args(argv)
    if args.issue26:
        args.layers, args.experts, args.top_k, args.expert_width = 2, 64, 8, 192
    load_before = os.getloadavg()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch
    import transformers

    import parallm
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75), moe_intermediate_size=args.expert_width,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=8000, max_position_embeddings=4 * args.seq,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).float()
    default_impl = hf.config._experts_implementation
    b, s = args.batch, args.seq
    chunks, hf_step, pl_step, _ = one_process_pair(hf, batch=b, seq=s, loss=ce_loss, prefix="parallm-moebench-")

    from parallm.model.layers.moe import Experts, expert_kernel_of
    kernel = expert_kernel_of(chunks)
    moe_layers = [layer.mlp for c in chunks for layer in c.layers if hasattr(layer.mlp, "experts")]
    tensors_per_layer = max(sum(1 for _ in m.parameters()) for m in moe_layers)

    def pl_loop_step():
        experts = [m for c in chunks for m in c.modules() if isinstance(m, Experts)]
        for m in experts:
            m.kernel = "loop"
        try:
            pl_step()
        finally:
            for m in experts:
                m.kernel = kernel

    def hf_eager_step():
        hf.set_experts_implementation("eager")
        try:
            hf_step()
        finally:
            hf.set_experts_implementation(default_impl)

    # Interleaved rounds (one step of each per round, best of the rounds): on a shared machine the load drifts,
    # and timing one side after the other would charge the drift to one of them.
    (t_pl, t_hf, t_eager, t_loop), (c_pl, c_hf, c_eager, c_loop) = interleaved(
        [pl_step, hf_step, hf_eager_step, pl_loop_step], args.iters)
    tokens = b * s
    rows = []
    for what, pl, hf_default, hf_eager, loop in (("wall", t_pl, t_hf, t_eager, t_loop),
                                                 ("CPU time", c_pl, c_hf, c_eager, c_loop)):
        rows += [
            (f"step {what}: parallm ({kernel}) / transformers ({default_impl})", f"{pl:.3f} s / {hf_default:.3f} s",
             f"{pl / hf_default:.2f}", "<= 0.9 (aim 0.7)" if what == "CPU time" else "report"),
            (f"step {what}: parallm ({kernel}) / transformers (eager expert loop)", f"{pl:.3f} s / {hf_eager:.3f} s",
             f"{pl / hf_eager:.2f}", "report"),
            (f"step {what}: parallm (loop kernel) / transformers ({default_impl})", f"{loop:.3f} s / "
             f"{hf_default:.3f} s", f"{loop / hf_default:.2f}", "report"),
        ]
    rows.append(("parameter tensors per MoE layer", str(tensors_per_layer), "", "<= 8"))
    print(f"model: Qwen3-MoE hidden {args.hidden}, {args.layers} layers (all routed), {args.experts} experts top-"
          f"{args.top_k} of width {args.expert_width}, vocab {cfg.vocab_size}; batch {b} x {s} ({tokens} tokens); "
          f"fp32, {torch.get_num_threads()} threads; parallm experts: {kernel}")
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}"
          + ("" if max(load_before[0], load_after[0]) < 2 else "  -- PROVISIONAL: machine not quiet"))
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
