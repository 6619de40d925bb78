"""Per-call collectives over the whole world: ``forward`` and ``forward_backward`` each make exactly one small
control collective over the world (the agreement that makes a bad batch on one rank an error on every rank, and
that also compares the batch fingerprints of each model replica's ranks); the checks that concern a group (the
expert-parallel microbatch count, a ``loss_fn`` that raised) run on that group or ride on the call's own
reductions.

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
    # the group checks do run on their groups (a MoE count exchange at cp2.ep2, and the model's own collectives)
    assert all(r["cp2.ep2"]["forward_backward"][1]["group"] >= 2 for r in res)


DEPRECATED = ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base")


def test_no_deprecated_collective_calls():
    """torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a FutureWarning on every
    call, which users saw from parallm's own calls): no module calls them directly; parallm's collectives go
    through ``parallel/comm.py``'s helpers (or the same ``getattr`` fallback), which take the new names."""
    import ast
    import pathlib

    import parallm
    root = pathlib.Path(parallm.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DEPRECATED:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.func.attr}")
    assert not found, found
