"""Pipelined forward benchmark (RL's log-prob pass). Not part of the test suite.

    PYTHONPATH=src python bench/forward_bench.py [--layers 8] [--hidden 512] [--seq 256] [--batch 8] [--iters 3]

``forward(output="logprobs")`` of ``batch`` sequences of a LLaMA-shaped fp32 model, wall time (best of
``iters``, after a warm-up) at pp = 2 on 2 ranks (one thread each), with the default microbatch count and with
one microbatch (the whole batch at once: what forward did before it pipelined), against the same call at
pp = 1 on one rank. Same weights, same tokens; the log-probs are compared. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world  # noqa: E402


def _rank(rank, world, ckpt, ids, pp, microbatches, iters, last_stage_layers=None):
    import torch

    import parallm
    parallm.init_parallel(pp=pp)
    split = {"num_layers_in_last_pipeline_stage": last_stage_layers} if pp > 1 and last_stage_layers else {}
    chunks = parallm.build_model(ckpt, **split)
    parallm.load_hf_weights(chunks, ckpt)
    mask = torch.ones_like(ids)
    out = {}
    for m in microbatches:
        def call(m=m):
            with torch.no_grad():
                return parallm.forward(chunks, ids, mask, output="logprobs", num_microbatches=m)
        lp = call()
        times = []
        for _ in range(iters):
            torch.distributed.barrier()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[m] = (min(times), lp)
    parallm.destroy_parallel()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--microbatches", default="", help="more microbatch counts to time at pp=2, e.g. 4,8")
    ap.add_argument("--last-stage-layers", type=int, default=None,
                    help="also time pp=2 with this many layers on the last stage (it holds the head)")
    args = ap.parse_args(argv)
    import torch

    from parallm.api import default_forward_microbatches
    from parallm.verify.reference import make_hf_model, tiny_config
    cfg = tiny_config("llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, vocab_size=args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    default = default_forward_microbatches(args.batch, 2)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "m")
        make_hf_model(cfg).save_pretrained(ckpt)
        one = run_world(_rank, 1, ckpt, ids, 1, [1], args.iters)[0]
        counts = sorted({1, default, *(int(x) for x in args.microbatches.split(",") if x)})
        two = run_world(_rank, 2, ckpt, ids, 2, counts, args.iters)[0]
        uneven = (run_world(_rank, 2, ckpt, ids, 2, [m for m in counts if m > 1], args.iters,
                            args.last_stage_layers)[0] if args.last_stage_layers else {})
    t1, lp1 = one[1]
    print(f"model: LLaMA-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32; "
          f"forward(output='logprobs') of {args.batch} x {args.seq} tokens; load {os.getloadavg()[0]:.2f}")
    print(f"pp=1, 1 rank:                         {t1:.3f} s")
    rows = [(f"pp=2, 2 ranks, {m} microbatch(es)", m, r) for m, r in sorted(two.items())]
    if uneven:
        split = f"{args.layers - args.last_stage_layers}+{args.last_stage_layers} layers"
        rows += [(f"pp=2, {split}, {m} mb", m, r) for m, r in sorted(uneven.items())]
    for label, m, (t, lp) in rows:
        label += " (default)" if m == default else ""
        print(f"{label:<38}{t:.3f} s   ratio to pp=1 {t / t1:.3f}   max |dlogprob| {(lp - lp1).abs().max():.1e}")


if __name__ == "__main__":
    main()
