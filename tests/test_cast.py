"""dtype conversion rules (parallm.checkpoint.cast) and the export plan (parallm.checkpoint.export.plan_buckets):
pure functions, no process group."""

import pytest
import torch

from parallm.checkpoint.cast import can_overflow, cast, check_cast, copy_cast_
from parallm.errors import CheckpointError

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def test_which_casts_can_overflow():
    narrowing = {(BF16, F16), (F32, F16), (F64, F16), (F32, BF16), (F64, BF16), (F64, F32)}
    for src in (F16, BF16, F32, F64):
        for dst in (F16, BF16, F32, F64):
            assert can_overflow(src, dst) == ((src, dst) in narrowing), (src, dst)
    assert not can_overflow(torch.int32, F16)


@pytest.mark.parametrize("src,dst", [(F32, F16), (BF16, F16), (F64, F16), (F32, BF16), (F64, F32)])
def test_overflow_boundary_matches_torch_rounding(src, dst):
    """The check refuses exactly the finite values torch's own cast turns into inf (round to nearest even)."""
    top = torch.finfo(dst).max
    # candidates around the rounding boundary, as representable in the source dtype
    probes = torch.tensor([top, top * (1 + 2.0 ** -12), top * (1 + 2.0 ** -10), top * (1 + 2.0 ** -9),
                           top * (1 + 2.0 ** -8), top * (1 + 2.0 ** -7), top * 1.01, top * 2], dtype=F64)
    probes = probes[torch.isfinite(probes.to(src))].to(src)
    assert len(probes) >= 3
    for value in probes:
        for sign in (1, -1):
            x = torch.full((3, 5), 0.5, dtype=src)
            x[1, 2] = sign * value
            becomes_inf = bool(torch.isinf(x.to(dst)).any())
            if becomes_inf:
                with pytest.raises(CheckpointError, match="overflow"):
                    check_cast(x, dst, "w")
            else:
                check_cast(x, dst, "w")


def test_overflow_message_is_the_catalogs():
    x = torch.zeros(4, 4)
    x[0, 0] = 1e6
    with pytest.raises(CheckpointError) as e:
        copy_cast_(torch.empty(4, 4, dtype=F16), x, ("model.layers.1.mlp.down_proj.weight",))
    assert str(e.value) == ("model.layers.1.mlp.down_proj.weight: values up to 1e+06 overflow torch.float16 "
                            "(max 65504); build the model in bfloat16 or float32")
    with pytest.raises(CheckpointError) as e:
        cast(x, F16, "a.weight", instead="export")
    assert str(e.value).endswith("overflow torch.float16 (max 65504); export in bfloat16 or float32")
    huge = torch.full((2,), 3.4e38)
    with pytest.raises(CheckpointError, match="overflow torch.bfloat16 .*; save in float32"):
        cast(huge, BF16, "b", instead="save")


def test_inf_and_nan_in_the_source_pass_through_for_every_dtype():
    """Values already inf / NaN are copied as they are (no error), whatever the cast; a finite value that would
    overflow next to them is still refused."""
    for src in (F16, BF16, F32, F64):
        for dst in (F16, BF16, F32, F64):
            x = torch.tensor([1.5, float("inf"), -float("inf"), float("nan"), -2.0], dtype=src)
            out = torch.empty(5, dtype=dst)
            copy_cast_(out, x, "w")
            assert torch.equal(out[:3], x[:3].to(dst)) and torch.isnan(out[3]) and out[4] == -2, (src, dst)
    x = torch.tensor([float("nan"), float("inf"), 1e6])
    with pytest.raises(CheckpointError, match="values up to 1e\\+06"):
        check_cast(x, F16, "w")
    check_cast(torch.tensor([float("nan"), float("inf")]), F16, "w")   # nothing finite: nothing to refuse


def test_copy_converts_exactly_as_torch_does():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 129, generator=g, dtype=F64) * 3
    for src in (F16, BF16, F32, F64):
        for dst in (F16, BF16, F32, F64):
            s = x.to(src)
            out = torch.empty(s.shape, dtype=dst)
            copy_cast_(out, s[:, :], "w")
            assert torch.equal(out, s.to(dst)), (src, dst)
            strided = s[:, 1:100:3]        # a non-contiguous source (a column slice), as row-parallel reads are
            out = torch.empty(strided.shape, dtype=dst)
            copy_cast_(out, strided, "w")
            assert torch.equal(out, strided.to(dst)), (src, dst)
    assert cast(x, None, "w", instead="save") is x          # nothing to do: no copy
    with pytest.raises(CheckpointError, match="not a floating-point type"):
        copy_cast_(torch.empty(3), torch.arange(3), "w")


# -- the export plan --------------------------------------------------------------------------------------------

def _pieces():
    # (entry, tp, src, shape): a big 2-D piece per TP rank, small 1-D ones, one piece of a single huge row
    return [(0, 0, 0, (40, 8)), (0, 1, 1, (40, 8)), (1, 0, 0, (8,)), (2, 0, 0, (16, 8)), (2, 1, 1, (16, 8)),
            (3, 0, 2, (3, 100)), (4, 0, 0, (5,))]


@pytest.mark.parametrize("numel", [1, 7, 8, 64, 100, 333, 10 ** 6])
def test_plan_covers_every_row_once_within_the_bucket(numel):
    from parallm.checkpoint.export import plan_buckets
    pieces = _pieces()
    buckets = plan_buckets(pieces, numel)
    seen = {}
    for b in buckets:
        rowsz = {p.row_numel for p in b.parts}
        assert b.numel <= numel or (len(b.parts) == 1 and b.parts[0].r1 - b.parts[0].r0 == 1), (numel, b)
        assert b.numel == sum(p.numel for p in b.parts) and rowsz
        off = 0
        for src, start, n in b.segments:           # each sender's parts are contiguous in the buffer
            mine = [p for p in b.parts if p.src == src]
            assert start == off and n == sum(p.numel for p in mine)
            assert [p.offset for p in mine] == [start + sum(q.numel for q in mine[:k]) for k in range(len(mine))]
            off += n
        assert len({s for s, _, _ in b.segments}) == len(b.segments)
        for p in b.parts:
            for r in range(p.r0, p.r1):
                key = (p.entry, p.tp, r)
                assert key not in seen, key
                seen[key] = True
    expected = {(e, t, r) for e, t, _, shape in pieces for r in range(shape[0])}
    assert set(seen) == expected
    # global order is kept: an entry's parts never come after a later entry's parts
    order = [p.entry for b in buckets for p in sorted(b.parts, key=lambda p: (p.entry, p.tp, p.r0))]
    assert order == sorted(order)
    if numel >= 10 ** 6:
        assert len(buckets) == 1
