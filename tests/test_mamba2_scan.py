"""Mamba-2's torch SSD scan passes the state from chunk to chunk (linear in the number of chunks), fp32, no process
group:

* equal to the former all-pairs formula (one ``[R, h, n+1, n+1]`` decay matrix over chunks, kept here as the
  reference) and to transformers' ``mamba2_chunk_scan`` at 1, 2, 5 and 17 chunks, with a partial last chunk,
  with document resets (a packed stream's chunks), with holes (stretches of zero input, as padded rows have),
  and with groups of chunks of every size (the budget lowered so that 1, 2, 3 chunks make a group);
* an initial state: equal to the token-by-token recurrence started from it, and a row scanned in two halves
  (the second from the first's final state, taken from the recurrence) equals the row scanned whole;
* memory linear in the length: the largest tensor any operation makes grows at most 4.5x for 4x the tokens
  (the all-pairs formula's decay matrix grows 16x).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_nemotron_h import _recurrence, _ssd_inputs


def old_ssd_scan(x, dt, a, b, c, *, chunk, d=None, reset=None):
    """The all-pairs formula the torch kernel used before (transformers' torch path, cut at document starts)."""
    from parallm.model.layers.mamba2 import segment_sum
    rows, length, heads, _ = x.shape
    groups = b.shape[2]
    x, dt = x.float(), dt.float()
    b = b.float().repeat_interleave(heads // groups, dim=2)
    c = c.float().repeat_interleave(heads // groups, dim=2)
    pad = (-length) % chunk
    skip = d.float()[:, None] * x if d is not None else None
    xs = x * dt[..., None]
    ad = a.float() * dt
    if pad:
        xs, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xs, b, c))
        ad = F.pad(ad, (0, 0, 0, pad))
    n = (length + pad) // chunk
    xs, b, c = (t.reshape(rows, n, chunk, heads, -1) for t in (xs, b, c))
    ad = ad.reshape(rows, n, chunk, heads).permute(0, 3, 1, 2)
    cum = torch.cumsum(ad, dim=-1)
    decay_in = torch.exp(segment_sum(ad))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay_in.permute(0, 2, 3, 4, 1)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
    to_end = torch.exp(cum[..., -1:] - cum)
    states = torch.einsum("bclhn,bclhp->bchpn", b * to_end.permute(0, 2, 3, 1)[..., None], xs)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    over = torch.exp(segment_sum(F.pad(cum[..., -1], (1, 0))))
    if reset is not None and bool(reset[1:].any()):
        doc = torch.cumsum(reset.long(), 0)
        target = torch.cat([doc, doc[-1:]])
        source = torch.cat([doc[:1], doc])
        over = over * (target[:, None] == source[None, :]).to(over.dtype)
    start = torch.einsum("bhts,bshpn->bthpn", over, states)[:, :-1]
    y = y + torch.einsum("bclhn,bchpn->bclhp", c, start) * torch.exp(cum).permute(0, 2, 3, 1)[..., None]
    y = y.reshape(rows, n * chunk, heads, -1)[:, :length]
    return y + skip if skip is not None else y


@pytest.mark.parametrize("length", [8, 13, 37, 133])          # 1, 2, 5, 17 chunks of 8 (the last partial)
def test_scan_equals_the_all_pairs_formula_and_transformers(length):
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    from parallm.model.layers import mamba2
    x, dt_raw, a, b, c, d, bias = _ssd_inputs(2, length)
    dt = F.softplus(dt_raw + bias)
    n = -(-length // 8)
    ref = hf.mamba2_chunk_scan(x, dt_raw, a, b, c, chunk_size=8, D=d, dt_bias=bias, dt_softplus=True)
    old = old_ssd_scan(x, dt, a, b, c, chunk=8, d=d)
    assert (old - ref).abs().max() < 1e-5
    for group in (1, 2, 3, None):            # chunks per group (None: the default budget, every chunk at once)
        budget = None if group is None else group * 2 * 8 * 8 * 8         # rows x heads x chunk x chunk
        new = mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, budget=budget)
        assert (new - old).abs().max() < 2e-5, (group, (new - old).abs().max())
    # document resets at chunks 1 and (5 chunks and more) 3; holes: zero input over a stretch
    reset = torch.zeros(n, dtype=torch.bool)
    reset[0] = True
    reset[1:n:3] = True
    holed = x.clone()
    holed[:, length // 3: length // 2] = 0
    for inputs in ((x, dt), (holed, dt * (holed.abs().sum(-1) > 0))):
        old = old_ssd_scan(*inputs[:1], inputs[1], a, b, c, chunk=8, d=d, reset=reset)
        for group in (1, 2, None):
            budget = None if group is None else group * 2 * 8 * 8 * 8
            new = mamba2.ssd_scan(*inputs[:1], inputs[1], a, b, c, chunk=8, d=d, reset=reset, budget=budget)
            assert (new - old).abs().max() < 2e-5, (group, (new - old).abs().max())
    # the resets matter
    assert (mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, reset=reset) - ref).abs().max() > 1e-2 or n == 1


def _recurrence_from(x, dt, a, b, c, d, s0):
    """:func:`_recurrence` from the state ``s0`` ``[h, p, n]``; returns (y, the final state)."""
    length, heads, p = x.shape
    rep = heads // b.shape[1]
    bh, ch = b.repeat_interleave(rep, dim=1), c.repeat_interleave(rep, dim=1)
    state = s0.double()
    out = []
    for t in range(length):
        da = torch.exp(dt[t].double() * a.double())[:, None, None]
        state = state * da + (dt[t].double()[:, None, None] * x[t].double()[..., None] * bh[t].double()[:, None])
        out.append((state @ ch[t].double()[..., None])[..., 0] + d.double()[:, None] * x[t].double())
    return torch.stack(out).float(), state.float()


def test_initial_state():
    from parallm.model.layers import mamba2
    x, dt_raw, a, b, c, d, bias = _ssd_inputs(1, 45, seed=3)
    dt = F.softplus(dt_raw + bias)
    s0 = torch.randn(1, 8, 4, 6, generator=torch.Generator().manual_seed(4))
    want, _ = _recurrence_from(x[0], dt[0], a, b[0], c[0], d, s0[0])
    for budget in (2 * 8 * 8 * 8 // 2, None):
        got = mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, initial=s0, budget=budget)
        assert (got[0] - want).abs().max() < 1e-4
    assert (mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d)[0] - want).abs().max() > 1e-2     # it matters
    # two halves: the second from the first's final state equals the whole row
    whole = mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d)
    _, mid = _recurrence_from(x[0, :20], dt[0, :20], a, b[0, :20], c[0, :20], d, torch.zeros(8, 4, 6))
    second = mamba2.ssd_scan(x[:, 20:], dt[:, 20:], a, b[:, 20:], c[:, 20:], chunk=8, d=d, initial=mid[None])
    assert (second - whole[:, 20:]).abs().max() < 1e-4
    # a reset at chunk 0 does not drop the initial state (the row starts from it)
    reset = torch.zeros(6, dtype=torch.bool)
    reset[0] = True
    assert torch.equal(mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, initial=s0, reset=reset),
                       mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, initial=s0))


def _largest(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    with Largest():
        fn()
    return Largest.biggest


def test_memory_linear_in_the_length():
    """One row, 2 heads of 4 channels, state 6, chunks of 8: 512 and 2048 tokens (64 and 256 chunks)."""
    from parallm.model.layers import mamba2
    sizes = {}
    for length in (512, 2048):
        x, dt_raw, a, b, c, d, bias = _ssd_inputs(1, length, heads=2, groups=1)
        dt = F.softplus(dt_raw + bias)
        sizes[length] = (_largest(lambda: mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d, budget=1 << 10)),
                         _largest(lambda: old_ssd_scan(x, dt, a, b, c, chunk=8, d=d)))
    new, old = sizes[2048][0] / sizes[512][0], sizes[2048][1] / sizes[512][1]
    assert new <= 4.5, sizes
    assert old > 8, sizes               # the all-pairs decay matrix: quadratic in the chunks
