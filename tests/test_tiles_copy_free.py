"""The sliding-window / context-parallel tiles (model/layers/blocks.py) without copies of the whole q / k / v (and
in the backward out / grad / lse) with a zero row appended: the tiles gather their rows straight from the
tensors (a missing row reads row 0: masked out as a key, zeroed as a query in the backward) and the gradients
are added straight into dq / dk / dv. Held bit for bit to the previous implementation (kept here as the
reference: every input padded by a zero row, tiles gathered from it, gradients accumulated beside and added once)
on the CPU's fused kernel and the fp32 math kernel, fp32 and bf16, packed documents under windows (tiles with
missing rows: documents shorter than a tile, tails), padded rows (``width`` 3) and a context-parallel piece
that sees every key (a full tile missing query rows), forward and backward; unzeroed missing query rows in the
backward must fail it. The
existing sliding-window and context-parallel tests hold it against transformers / masked SDPA."""

from __future__ import annotations

import pytest
import torch


def _old_with_zero_row(x):
    return torch.cat([x.float(), x.new_zeros((1,) + tuple(x.shape[1:]), dtype=torch.float32)])


def _old_gather(x, index):
    return x[index % x.shape[0]].permute(0, 2, 1, 3)


def _old_forward(block_fwd, q, k, v, plan, scale):
    tiles = plan.tiles(q.device)
    hq, d = q.shape[1], q.shape[2]
    qz, kz, vz = _old_with_zero_row(q), _old_with_zero_row(k), _old_with_zero_row(v)
    rows, outs, lses = [], [], []
    for g, masked in tiles.groups(hq):
        qi, ki, mask, any_key = tiles.build(g, masked)
        o, lse = block_fwd(_old_gather(qz, qi), _old_gather(kz, ki), _old_gather(vz, ki), False, scale, mask=mask)
        lse = lse.masked_fill(~any_key[:, None, :], float("-inf"))
        keep = (qi.reshape(-1) >= 0).nonzero().squeeze(-1)
        rows.append(qi.reshape(-1).index_select(0, keep))
        outs.append(o.permute(0, 2, 1, 3).reshape(-1, hq, d).index_select(0, keep))
        lses.append(lse.permute(0, 2, 1).reshape(-1, hq).index_select(0, keep))
    return torch.cat(rows), torch.cat(outs), torch.cat(lses)


def _old_backward(block_bwd, q, k, v, out, lse, grad, plan, scale, dq, dk, dv):
    tiles = plan.tiles(q.device)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    qz, kz, vz, oz, gz = (_old_with_zero_row(x) for x in (q, k, v, out, grad))
    lz = _old_with_zero_row(lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    dqz, dkz, dvz = (x.new_zeros((x.shape[0] + 1,) + tuple(x.shape[1:]), dtype=torch.float32) for x in (q, k, v))
    for g, masked in tiles.groups(hq):
        qi, ki, mask, _ = tiles.build(g, masked)
        gdq, gdk, gdv = block_bwd(_old_gather(qz, qi), _old_gather(kz, ki), _old_gather(vz, ki),
                                  _old_gather(oz, qi), _old_gather(lz, qi)[..., 0], _old_gather(gz, qi), False,
                                  scale, mask=mask)
        dqz.index_add_(0, qi.reshape(-1) % dqz.shape[0], gdq.permute(0, 2, 1, 3).reshape(-1, hq, d))
        dkz.index_add_(0, ki.reshape(-1) % dkz.shape[0], gdk.permute(0, 2, 1, 3).reshape(-1, hkv, d))
        dvz.index_add_(0, ki.reshape(-1) % dvz.shape[0], gdv.permute(0, 2, 1, 3).reshape(-1, hkv, d))
    dq.add_(dqz[:-1])
    dk.add_(dkz[:-1])
    dv.add_(dvz[:-1])


def _plans():
    """(name, plan, rows): packed documents (shorter than a tile, longer than the window, tails) and a padded
    batch of 3 rows side by side, under windows 1, 5 and 16."""
    from parallm.model.layers.attention import make_packing
    from parallm.model.layers.pieces import Piece, PiecePlan
    lengths = [83, 2, 16, 17, 9]
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    packing = make_packing(mask, multiple=4)
    out = [(f"packed w{w}", packing.window_plan(w), packing.total) for w in (1, 5, 16)]
    s = 37
    out += [(f"padded w{w}", PiecePlan([Piece(0, s, 0, s, 0)], width=3, window=w), 3 * s) for w in (5, 16)]
    # a context-parallel piece: 37 queries that see all 64 keys (a full tile of 64 keys missing 27 query rows;
    # query rows 37-63 in no piece)
    out.append(("every key", PiecePlan([Piece(0, 37, 0, 64, 64)]), 64))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_name", ["cpu-flash", "math"])
def test_tiles_equal_the_zero_row_version_bit_for_bit(dtype, kernel_name):
    from parallm.model.layers import blocks
    kernel = {"cpu-flash": blocks.CPU_FLASH_BLOCK, "math": blocks.MATH_BLOCK}[kernel_name]
    hq, hkv, d = 4, 2, 16
    for name, plan, rows in _plans():
        g = torch.Generator().manual_seed(rows)
        q, k, v = (torch.randn(rows, h, d, generator=g).mul_(2).to(dtype) for h in (hq, hkv, hkv))
        scale = 1.0
        new = blocks.tiles_forward(kernel.forward, q, k, v, plan, scale)
        old = _old_forward(kernel.forward, q, k, v, plan, scale)
        assert new[0].numel() > rows or name.endswith("w1") or name == "every key", name     # rows merged
        for a, b in zip(new, old):
            assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
        acc = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        blocks.merge_rows(acc, lse, *new)
        grad = torch.randn(q.shape, generator=g).to(dtype)
        got = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
        want = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
        blocks.tiles_backward(kernel.backward, q, k, v, acc, lse, grad, plan, scale, *got)
        _old_backward(kernel.backward, q, k, v, acc, lse, grad, plan, scale, *want)
        for x, a, b in zip("qkv", got, want):
            assert torch.equal(a, b), (name, x, (a - b).abs().max())
            assert a.abs().max() > 0, (name, x)
        # a break that must fail: a missing query row left unzeroed in the backward (it reads row 0's values),
        # seen where a full (unmasked) tile misses query rows: the every-key piece's
        tiles = plan.tiles("cpu")
        if not any(not m and bool((tiles.build(s, m)[0] < 0).any()) for s, m in tiles.groups(hq)):
            assert name != "every key", name
            continue
        broken = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
        real_gather = blocks._gather_tiles
        try:
            blocks._gather_tiles = lambda x, index, pad=None: real_gather(x, index)
            blocks.tiles_backward(kernel.backward, q, k, v, acc, lse, grad, plan, scale, *broken)
        finally:
            blocks._gather_tiles = real_gather
        assert not all(torch.equal(a, b) for a, b in zip(broken, want)), name
