"""The vectorised INT4 arithmetic (checkpoint/int4.py: ``unpack``'s byte spread, ``dequantize``'s per-group
broadcast) against the compressed-tensors definition written out per nibble and per column here: every bit
pattern of the words, every scale dtype a checkpoint may store (bf16, fp16, fp32) with extreme scales (subnormal,
near overflow, zero, negative), zero points, group sizes that do not divide a word, unaligned column slices, the
big-endian fallback; compared bit for bit (NaN / inf included). tests/test_kimi_k25_parts.py covers the
reader on real quantised weights and against the compressed-tensors package."""

from __future__ import annotations

import sys

import pytest
import torch

from parallm.checkpoint import int4
from parallm.checkpoint.int4 import Int4Source, Scheme, dequantize, unpack
from parallm.model.sharding import TensorSource


def words(rows: int, n: int, seed: int, plant: bool = True) -> torch.Tensor:
    """int32 words with every nibble value, the extremes first (``plant``)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, n), generator=g, dtype=torch.int64).to(torch.int32)
    extremes = torch.tensor([0, -1, -2 ** 31, 2 ** 31 - 1, 0x76543210, -0x789ABCDF], dtype=torch.int32)
    if plant:
        w.view(-1)[:len(extremes)] = extremes
    return w


def unpack_definition(w: torch.Tensor, count: int) -> torch.Tensor:
    """Value ``j`` of each word at bits ``4j``, as ``nibble - 8`` (compressed-tensors' ``unpack_from_int32``)."""
    u = w.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*w.shape[:-1], w.shape[-1] * 8, dtype=torch.int64)
    for j in range(8):
        out[..., j::8] = ((u >> (4 * j)) & 0xF) - 8
    return out[..., :count]


def dequantize_definition(q, scale, zero, group):
    """``(q - z) * s`` in the scale's dtype, each column's group gathered (compressed-tensors' ``_dequantize``)."""
    out = q.to(scale.dtype)
    if zero is not None:
        out = out - zero.repeat_interleave(group, -1).to(scale.dtype)
    return out * scale.repeat_interleave(group, -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def scales(rows: int, groups: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random scales of ``dtype`` with its extremes planted: the smallest subnormal, the largest finite (times 7
    overflows), zero, negatives."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.rand(rows, groups, generator=g) * 0.02 + 1e-4).to(dtype)
    info = torch.finfo(dtype)
    planted = torch.tensor([info.smallest_normal / 4, info.tiny, info.max, -info.max / 3, 0.0, -0.0123],
                           dtype=torch.float64).to(dtype)
    s.view(-1)[:len(planted)] = planted
    return s


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_unpack_equals_the_definition(monkeypatch, byteorder):
    monkeypatch.setattr(sys, "byteorder", byteorder)     # "big": the per-nibble fallback
    w = words(5, 7, seed=0)
    for count in (56, 53, 1):
        got = unpack(w, count)
        assert got.dtype == torch.int8 and torch.equal(got.long(), unpack_definition(w, count))
    t = words(6, 4, seed=1).t()                           # transposed (zero points are unpacked that way)
    assert torch.equal(unpack(t, 48).long(), unpack_definition(t.contiguous(), 48))
    # a break the comparison sees: the two nibbles of each byte swapped
    swapped = unpack_definition(w, 56).view(5, 28, 2).flip(-1).reshape(5, 56)
    assert not torch.equal(unpack(w, 56).long(), swapped)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group,zero", [(32, False), (8, True), (4, True), (12, False)])
def test_dequantize_equals_the_definition(dtype, group, zero):
    rows, groups = 9, 4
    cols = groups * group
    q = unpack_definition(words(rows, -(-cols // 8), seed=group, plant=False), cols).to(torch.int8)
    s = scales(rows, groups, dtype, seed=group)
    z = unpack_definition(words(2, groups, seed=7, plant=False).t().contiguous(), rows).t().to(torch.int8) if zero else None
    got = dequantize(q, s, z, group)
    want = dequantize_definition(q, s, z, group)
    assert same_bits(got, want)
    tiny = torch.finfo(dtype).tiny
    assert torch.isinf(want).any() and ((want != 0) & (want.abs() < tiny)).any()      # overflow, subnormals
    # breaks the comparison sees: each column taking the next group's scale, the zero point ignored
    assert not same_bits(dequantize(q, s.roll(1, -1), z, group), want)
    if zero:
        assert not same_bits(dequantize(q, s, None, group), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group,symmetric", [(32, True), (12, False), (4, False)])
def test_int4_source_slices(dtype, group, symmetric):
    rows, groups = 11, 5
    cols = groups * group
    packed = words(rows, -(-cols // 8), seed=3)
    parts = {"weight_packed": packed, "weight_scale": scales(rows, groups, dtype, seed=4),
             "weight_shape": torch.tensor([rows, cols])}
    zero = None
    if not symmetric:
        parts["weight_zero_point"] = words(-(-rows // 8), groups, seed=5)
        zero = unpack_definition(parts["weight_zero_point"].t(), rows).t()
    src = Int4Source("m", {k: TensorSource(v) for k, v in parts.items()}, (rows, cols),
                     Scheme("g", ("Linear",), group, symmetric))
    full = dequantize_definition(unpack_definition(packed, cols), parts["weight_scale"], zero, group)
    assert same_bits(src.full(), full)
    for a, b in ((0, rows), (2, 9), (10, 11)):
        assert same_bits(src.read(0, a, b), full[a:b])
    for a, b in ((0, cols), (1, cols - 1), (group, 2 * group), (group - 1, group + 1), (cols - 1, cols), (3, 5)):
        assert same_bits(src.read(1, a, b), full[:, a:b])


def test_dequantize_refuses_values_that_are_not_whole_groups():
    with pytest.raises(ValueError, match=r"\(3, 30\) values do not make 3 rows of 1 groups of 32"):
        dequantize(torch.zeros(3, 30, dtype=torch.int8), torch.ones(3, 1), None, 32)
    with pytest.raises(ValueError, match="packed INT4 weights are int32"):
        int4.unpack(torch.zeros(2, 2, dtype=torch.int64), 16)
    with pytest.raises(ValueError, match=r"zero points \(3, 2\) do not match scales \(3, 1\)"):
        dequantize(torch.zeros(3, 32, dtype=torch.int8), torch.ones(3, 1), torch.zeros(3, 2), 32)
