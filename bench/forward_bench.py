"""Pipelined forward benchmark (RL's log-prob pass). Not part of the test suite.

    PYTHONPATH=src python bench/forward_bench.py [--layers 8] [--hidden 512] [--seq 256] [--batch 8] [--iters 3]
        [--microbatches 2,4] [--last-stage-layers N] [--rounds 1]

``forward(output="logprobs")`` of ``batch`` sequences of a LLaMA-shaped fp32 model, wall time (best of
``iters`` after a warm-up; with ``--rounds``, pp=1 and pp=2 timed in turn and the best of every round kept) at
pp = 2 on 2 ranks (one thread each), against the same call at pp = 1 on one rank: with the even layer split
and with ``build_model(layers_per_stage="balanced")`` (the last stage, which holds the head, gets fewer
layers), each with the default microbatch count, with one microbatch (the whole batch at once: what forward did
before it pipelined) and with the ``--microbatches`` counts. Same weights, same tokens; the
log-probs are compared. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world  # noqa: E402


def _rank(rank, world, ckpt, ids, pp, microbatches, iters, split=None):
    import torch

    import parallm
    parallm.init_parallel(pp=pp)
    chunks = parallm.build_model(ckpt, **(split or {}))
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
    out["split"] = chunks[0].dims.layer_split
    parallm.destroy_parallel()
    return out


def _best(old, new):
    """Per microbatch count, the faster of two rounds' (time, log-probs)."""
    if old is None:
        return new
    return {k: (min(old[k], new[k], key=lambda r: r[0]) if k != "split" else new[k]) for k in new}


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
    ap.add_argument("--rounds", type=int, default=1, help="time pp=1 and pp=2 in turn this many times, keep the best")
    ap.add_argument("--no-balanced", action="store_true", help="skip the balanced split")
    args = ap.parse_args(argv)
    import torch

    from parallm.api import default_forward_microbatches
    from parallm.verify.reference import make_hf_model, tiny_config
    cfg = tiny_config("llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, vocab_size=args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    default = default_forward_microbatches(args.batch, 2, args.batch * args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "m")
        make_hf_model(cfg).save_pretrained(ckpt)
        counts = sorted({1, default, *(int(x) for x in args.microbatches.split(",") if x)})
        splits = [("even", None)]
        if not args.no_balanced:
            splits.append(("balanced", {"layers_per_stage": "balanced"}))
        if args.last_stage_layers:
            splits.append((None, {"num_layers_in_last_pipeline_stage": args.last_stage_layers}))
        one, timed = None, [(name, None) for name, _ in splits]
        for _ in range(args.rounds):    # pp=1 and pp=2 in turn, best of every round: the machine's drift hits both
            one = _best(one, run_world(_rank, 1, ckpt, ids, 1, [1], args.iters)[0])
            timed = [(name, _best(prev, run_world(_rank, 2, ckpt, ids, 2, counts, args.iters, split)[0]))
                     for (name, prev), (_, split) in zip(timed, splits)]
    t1, lp1 = one[1]
    print(f"model: LLaMA-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32; "
          f"forward(output='logprobs') of {args.batch} x {args.seq} tokens; load {os.getloadavg()[0]:.2f}")
    print(f"pp=1, 1 rank:                         {t1:.3f} s")
    for name, two in timed:
        layers = two.pop("split") or (args.layers // 2, args.layers - args.layers // 2)
        label = f"pp=2, {name + ' ' if name else ''}{'+'.join(map(str, layers))} layers"
        for m, (t, lp) in sorted(two.items()):
            row = f"{label}, {m} mb" + (" (default)" if m == default else "")
            print(f"{row:<44}{t:.3f} s   ratio to pp=1 {t / t1:.3f}   max |dlogprob| {(lp - lp1).abs().max():.1e}")


if __name__ == "__main__":
    main()
