"""dtype conversion rules (parallm.checkpoint.cast) and the export plan (parallm.checkpoint.export.plan_buckets, run in one process):
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

def _entries(tp=2):
    """Entries of every layout kind at ``tp`` (sender of TP rank t's piece: global rank t, entry 3 on rank 2):
    (entry, hf shapes, pieces) as the planner takes them, plus the HF tensors and each piece's shard."""
    from parallm.model.sharding import GateUpSplit, QKVSplit, Replicated, Split, TensorSource, VocabSplit
    g = torch.Generator().manual_seed(0)
    kinds = [(QKVSplit(4, 1, 3), [(12, 8), (3, 8), (3, 8)]), (Split(0), [(40, 8)]), (Replicated(), [(8,)]),
             (Split(1), [(6, 10)]), (GateUpSplit(), [(16, 8), (16, 8)]), (VocabSplit(9, 10), [(9, 5)]),
             (Split(0), [(2, 100)])]
    entries, hf, shards = [], {}, {}
    for i, (layout, shapes) in enumerate(kinds):
        tensors = [torch.randn(s, generator=g) for s in shapes]
        hf.update({(i, k): t for k, t in enumerate(tensors)})
        pieces = []
        for t in (range(tp) if layout.tp_dim is not None else [0]):
            src = 2 if i == 3 else t
            shards[(i, t)] = layout.shard([TensorSource(x) for x in tensors], t, tp)
            assert tuple(shards[(i, t)].shape) == layout.shard_shape(t, tp, shapes)
            pieces.append((t, src, tuple(shards[(i, t)].shape), layout.blocks(t, tp, shapes)))
        entries.append((i, shapes, pieces))
    return entries, hf, shards


@pytest.mark.parametrize("numel", [1, 7, 8, 64, 100, 333, 10 ** 6])
@pytest.mark.parametrize("direct", [1, 30, 10 ** 9])
def test_plan_puts_every_element_once_in_its_place(numel, direct):
    """Running the plan in one process (each part copied from its shard into the bucket buffer, then the stream's
    own placing of packed parts) rebuilds every HF tensor exactly; every element is written once; buckets and
    parts keep within the bucket; each sender's packed parts are contiguous; direct parts are whole rows of at
    least ``direct`` elements."""
    from parallm.checkpoint.export import _as_rows, _place, plan_buckets
    entries, hf, shards = _entries()
    buckets = plan_buckets(entries, numel, direct)
    shapes = {f"{e}.{k}": tuple(s) for e, ss, _ in entries for k, s in enumerate(ss)}
    seen_entries = []
    for b in buckets:
        entries_here = sorted({e for e, _, _ in b.outputs})
        seen_entries += entries_here
        assert b.numel <= numel or len(entries_here) == 1, (numel, b)
        for p in b.parts:
            assert p.numel <= numel or p.rows == 1
            assert not p.direct or (p.dim == 0 and p.numel >= direct)
        off = max(off + _n(shapes[f"{e}.{k}"]) for e, k, off in b.outputs)   # staging starts after the tensors
        for src, start, n in b.segments:
            mine = [p for p in b.parts if p.src == src and not p.direct]
            assert start == off and n == sum(p.numel for p in mine)
            assert [p.offset for p in mine] == [start + sum(q.numel for q in mine[:k]) for k in range(len(mine))]
            off += n
        assert off == b.numel and len({s for s, _, _ in b.segments}) == len(b.segments)
        buf = torch.full((b.numel,), float("nan"))          # an element nobody writes stays NaN
        for p in b.parts:
            piece = _as_rows(shards[(p.entry, p.tp)])[p.row_start:p.row_stop, p.col_start:p.col_stop]
            buf.narrow(0, p.offset, p.numel).view(p.rows, p.cols).copy_(piece)
        for (e, k, o), parts in zip(b.outputs, b.placing):
            tensor = buf.narrow(0, o, _n(shapes[f"{e}.{k}"])).view(shapes[f"{e}.{k}"])
            _place(parts, tensor, buf)
            assert torch.equal(tensor, hf[(e, k)]), (e, k, numel, direct)
        # every element written, and as many writes as elements: each written exactly once
        assert sum(p.numel for p in b.parts) == sum(_n(shapes[f"{e}.{k}"]) for e, k, _ in b.outputs)
    assert seen_entries == [e for e, _, _ in entries]        # global order, each entry in one bucket
    if numel >= 10 ** 6:
        assert len(buckets) == 1


def _n(shape):
    n = 1
    for d in shape:
        n *= d
    return n
