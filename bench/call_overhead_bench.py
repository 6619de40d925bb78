"""Per-call overhead of parallm's entry points on local ranks: a tiny ``forward`` / ``forward_backward`` whose
compute is negligible, so what is timed is the call's own bookkeeping (checks, agreements, the schedule).
Not part of the test suite (tests/test_call_collectives.py runs its counting in --quick form).

    PYTHONPATH=src python bench/call_overhead_bench.py [--worlds 1,2,4,8] [--iters 50] [--quick]

For each world size (local gloo ranks, one thread each) and layout (``dp`` = every rank a data-parallel
replica; at world >= 4 also ``tp2.pp2`` and a MoE ``cp2.ep2``), the median wall time per call after a
warm-up, and the collectives each call issues: over the whole world (the world group or parallm's gloo control
group: a latency that grows with the world and a barrier across pipeline stages) and over smaller groups,
counted by wrapping ``torch.distributed``'s functions. Same tiny model (2 layers, hidden 64), 2 sequences of 8
tokens per replica. Run it with nothing else on the machine; ``--quick`` (worlds 1 and 2, 3 calls) only checks
that it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world  # noqa: E402

# the torch.distributed functions parallm's calls may reach (point-to-point is counted apart)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "barrier",
               "gather_object", "scatter", "reduce", "all_gather_single", "reduce_scatter_single")


class CollectiveCounter:
    """Counts ``torch.distributed`` collectives while active (a context manager): ``world`` (over the world
    group, or parallm's control group, which spans the world), ``group`` (any smaller group) and ``p2p``
    (``batch_isend_irecv`` batches)."""

    def __init__(self):
        self.world = self.group = self.p2p = 0
        self._saved = {}

    def _is_world(self, group) -> bool:
        import torch.distributed as dist

        from parallm.parallel.state import control_group
        return group is None or group is dist.group.WORLD or group is control_group()

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            group = kwargs.get("group")
            if group is None and name in ("all_reduce", "all_gather", "broadcast", "all_gather_object",
                                           "all_gather_into_tensor", "reduce_scatter_tensor", "reduce"):
                group = _positional_group(name, args)
            if self._is_world(group):
                self.world += 1
            else:
                self.group += 1
            return fn(*args, **kwargs)
        return wrapped

    def __enter__(self):
        import torch.distributed as dist
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        p2p = dist.batch_isend_irecv
        self._saved["batch_isend_irecv"] = p2p

        def counted(*args, **kwargs):
            self.p2p += 1
            return p2p(*args, **kwargs)
        dist.batch_isend_irecv = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    def take(self) -> dict:
        out = dict(world=self.world, group=self.group, p2p=self.p2p)
        self.world = self.group = self.p2p = 0
        return out


def _positional_group(name, args):
    """The ``group`` argument when passed positionally (torch's signatures)."""
    index = {"all_reduce": 2, "all_gather": 2, "broadcast": 2, "all_gather_object": 2, "all_gather_into_tensor": 2,
             "reduce_scatter_tensor": 3, "reduce": 3}[name]
    return args[index] if len(args) > index else None


def tiny_checkpoint(path: str, *, moe: bool = False) -> str:
    """A 2-layer, hidden-64 model (Qwen2, or Qwen3-MoE with 4 experts) saved with transformers."""
    from parallm import verify
    if moe:
        cfg = verify.tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        cfg = verify.tiny_config("qwen2")
    model = verify.make_hf_model(cfg, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    return path


LAYOUTS = {"dp": {}, "tp2.pp2": dict(tp=2, pp=2), "cp2.ep2": dict(cp=2, ep=2)}


def rank_fn(rank, world, ckpts, layouts, iters):
    """Per layout: {"forward": (median s, counts per call), "forward_backward": (...)} on this rank."""
    import torch

    import parallm
    out = {}
    for name in layouts:
        parallm.init_parallel(**LAYOUTS[name])
        chunks = parallm.build_model(ckpts["moe" if "ep" in name else "dense"])
        parallm.load_hf_weights(chunks, ckpts["moe" if "ep" in name else "dense"])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, chunks[0].spec.vocab_size, (2, 8), generator=g)
        mask = torch.ones_like(ids)
        calls = {
            "forward": lambda: parallm.forward(chunks, ids, mask, output="logprobs"),
            "forward_backward": lambda: parallm.forward_backward(
                chunks, ids, mask, loss_fn=lambda o, i, m: (o.sum(), m.sum()), output="logprobs"),
        }
        result = {}
        for call_name, call in calls.items():
            call()     # warm-up: groups' first use, caches
            counter = CollectiveCounter()
            times, counts = [], None
            for _ in range(iters):
                with counter:
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                c = counter.take()
                counts = c if counts is None else counts
                if c != counts:
                    raise RuntimeError(f"{name} {call_name}: collectives differ between calls: {counts} vs {c}")
            result[call_name] = (statistics.median(times), counts)
        for c in chunks:
            c.zero_grad()
        out[name] = result
        parallm.destroy_parallel()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="worlds 1 and 2, 3 calls: checks that it runs")
    args = ap.parse_args(argv)
    worlds = [1, 2] if args.quick else [int(w) for w in args.worlds.split(",")]
    iters = 3 if args.quick else args.iters
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {"dense": tiny_checkpoint(os.path.join(tmp, "dense")),
                 "moe": tiny_checkpoint(os.path.join(tmp, "moe"), moe=True)}
        print(f"{'world':>5} {'layout':<9} {'call':<17} {'ms/call':>8} {'world coll.':>11} {'group coll.':>11} "
              f"{'p2p':>4}")
        rows = []
        for world in worlds:
            layouts = ["dp"] + (["tp2.pp2", "cp2.ep2"] if world >= 4 else [])
            res = run_world(rank_fn, world, ckpts, layouts, iters)
            for name in layouts:
                for call_name in ("forward", "forward_backward"):
                    t = max(r[name][call_name][0] for r in res)
                    worst = max((r[name][call_name][1] for r in res), key=lambda c: c["world"])
                    rows.append((world, name, call_name, t, worst))
                    print(f"{world:>5} {name:<9} {call_name:<17} {1e3 * t:>8.2f} {worst['world']:>11} "
                          f"{worst['group']:>11} {worst['p2p']:>4}")
    return rows


if __name__ == "__main__":
    main()
