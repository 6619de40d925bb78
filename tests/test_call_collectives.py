"""Per-call collectives over the whole world: ``forward`` and ``forward_backward`` each make exactly one small
control collective over the world (the agreement that makes a bad batch on one rank an error on every rank);
the checks that concern a group (the context-parallel batch fingerprint, the expert-parallel microbatch count,
a ``loss_fn`` that raised) run on that group or ride on the call's own reductions.

Counted by bench/call_overhead_bench.py's wrapper of ``torch.distributed`` (its per-rank function runs here, so
the bench is exercised too) on 4 ranks: dp4, tp2.pp2 and a MoE cp2.ep2, two calls each after a warm-up.
"""

from __future__ import annotations

import os
import sys

import pytest

import helpers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import call_overhead_bench as bench  # noqa: E402


@pytest.mark.timeout(300)
def test_one_world_collective_per_call(tmp_path):
    ckpts = {"dense": bench.tiny_checkpoint(str(tmp_path / "dense")),
             "moe": bench.tiny_checkpoint(str(tmp_path / "moe"), moe=True)}
    layouts = ["dp", "tp2.pp2", "cp2.ep2"]
    res = helpers.run_ranks(bench.rank_fn, 4, ckpts, layouts, 2)
    for rank, r in enumerate(res):
        for name in layouts:
            for call in ("forward", "forward_backward"):
                seconds, counts = r[name][call]
                print(f"rank {rank} {name} {call}: {counts}")
                assert counts["world"] == 1, (rank, name, call, counts)
    # the group checks do run on their groups (a CP fingerprint and a MoE count exchange at cp2.ep2)
    assert all(r["cp2.ep2"]["forward_backward"][1]["group"] >= 2 for r in res)
