"""Attention sinks (gpt-oss): one learned logit per head in every query's softmax denominator, no value.

The reference is transformers' ``GptOssAttention`` eager formula written out: scores (masked), the head's sink
appended as one more column, softmax, the sink's column dropped. Every attention path parallm has takes a sink:
padded rows (left / right padding, a hole, with and without a sliding window), packed documents, the emulated
CUDA block kernel, and context parallelism (all-gather and ring at cp2), where the sink must enter each query's
softmax once however its keys are split (added per piece or per ring step, it would count cp times). Forward and
the gradients of q, k, v and the sink.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from cuda_emulation import emulated_flash, local_slots


def sink_reference(q, k, v, allowed, sink):
    """q, k, v ``[B, S, h, d]`` (k / v with hkv heads), ``allowed`` bool ``[B, S, S]``, ``sink`` ``[h]``:
    transformers' eager attention with sinks (rows with no allowed key: zeros)."""
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    logits = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _allowed(mask, window=None):
    s = mask.shape[1]
    i = torch.arange(s)
    rel = i[:, None] - i[None]
    band = (rel >= 0) & (rel < (window or s + 1))
    return band[None] & mask.bool()[:, None, :] & mask.bool()[:, :, None]


def _inputs(b, s, h=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g)
    k, v = (torch.randn(b, s, hkv, d, generator=g) for _ in range(2))
    sink = torch.randn(h, generator=g) * 2
    go = torch.randn(b, s, h, d, generator=g)
    return q, k, v, sink, go


def _grads(fn, tensors, go, real):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * go * real[..., None, None]).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _mask():
    mask = torch.ones(4, 40, dtype=torch.long)
    mask[0, :9] = 0              # left padding
    mask[1, 31:] = 0             # right padding
    mask[2, 12:15] = 0           # a hole
    return mask


@pytest.mark.parametrize("window", [None, 8])
def test_padded_rows_with_sinks(window):
    from parallm.model.layers.attention import PaddedRows, padded_attention
    mask = _mask()
    q, k, v, sink, go = _inputs(*mask.shape)
    real = mask.bool()
    want = _grads(lambda q, k, v, s: sink_reference(q, k, v, _allowed(mask, window), s), (q, k, v, sink), go, real)

    def mine(q, k, v, s):
        out = padded_attention(*(t.transpose(1, 2) for t in (q, k, v)), PaddedRows(real), window=window, sink=s)
        return out.transpose(1, 2)

    got = _grads(mine, (q, k, v, sink), go, real)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        a, b = (a[real], b[real]) if name in ("out", "dq") else (a, b)
        assert (a - b).abs().max() < 1e-5, (name, window, (a - b).abs().max())
    # the sink matters: without it the output differs
    plain = padded_attention(*(t.transpose(1, 2) for t in (q, k, v)), PaddedRows(real), window=window)
    assert (plain.transpose(1, 2) - want[0])[real].abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kernel", ["cpu", "cuda-emulated"])
def test_packed_documents_with_sinks(window, kernel, monkeypatch):
    from parallm.model.layers import blocks
    from parallm.model.layers.attention import make_packing, sdpa_loop_varlen
    if kernel == "cuda-emulated":           # CUDA_BLOCK's plumbing with aten's flash op emulated in fp32
        fwd, bwd = emulated_flash()
        monkeypatch.setattr(blocks, "flash_forward", fwd)
        monkeypatch.setattr(blocks, "flash_backward", bwd)
        monkeypatch.setattr(blocks, "cuda_flash_usable", lambda q: True)
        monkeypatch.setattr(blocks, "block_kernel", lambda backend, device: blocks.CUDA_BLOCK)
    mask = _mask()
    q, k, v, sink, go = _inputs(*mask.shape, seed=1)
    real = mask.bool()
    packing = make_packing(mask)
    # transformers counts a hole's positions; packed documents are the row's real tokens: compare row by row on
    # the real tokens, as a packed model sees them
    allowed = torch.zeros(mask.shape[0], mask.shape[1], mask.shape[1], dtype=torch.bool)
    for b in range(mask.shape[0]):
        idx = real[b].nonzero().squeeze(-1)
        n = len(idx)
        i = torch.arange(n)
        rel = i[:, None] - i[None]
        allowed[b][idx[:, None], idx[None]] = (rel >= 0) & (rel < (window or n + 1))
    want = _grads(lambda q, k, v, s: sink_reference(q, k, v, allowed, s), (q, k, v, sink), go, real)

    def mine(q, k, v, s):
        flat = [t.reshape(-1, *t.shape[2:])[packing.indices] for t in (q, k, v)]
        out = sdpa_loop_varlen(*flat, packing, window=window, sink=s)
        full = torch.zeros(mask.numel(), *q.shape[2:])
        full[packing.indices] = out[:packing.nnz]
        return full.view(q.shape)

    got = _grads(mine, (q, k, v, sink), go, real)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        a, b = (a[real], b[real]) if name in ("out", "dq") else (a, b)
        assert (a - b).abs().max() < 1e-5, (name, kernel, window, (a - b).abs().max())


def rank_cp_sinks(rank, world, case):
    import torch.distributed as dist

    from parallm.model.context_parallel import CP_KERNELS, split_batch
    q, k, v, sink, go, mask, window, packed = (case[n] for n in ("q", "k", "v", "sink", "go", "mask", "window",
                                                                   "packed"))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    split = split_batch(torch.zeros_like(mask), pos, mask, cp=world, rank=rank, packed=packed)
    out = {}
    for name, fn in CP_KERNELS.items():
        leaves = [local_slots(t, split).clone().requires_grad_() for t in (q, k, v)]
        s = sink.clone().requires_grad_()
        o = fn(*leaves, split, dist.group.WORLD, window=window, sink=s)
        (o * local_slots(go * mask[..., None, None], split)).sum().backward()
        dsink = s.grad.clone()
        dist.all_reduce(dsink)              # each CP rank's queries' share: summed as finalize_grads sums cp
        out[name] = dict(mine=split.origin[rank * split.slots:(rank + 1) * split.slots], out=o.detach(),
                         dq=leaves[0].grad, dsink=dsink)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_context_parallel_adds_the_sink_once(packed):
    """cp2, all-gather and ring, a window shorter than a CP chunk too: outputs, dq and the CP-summed sink
    gradient equal the reference (a sink added per piece or per ring step would count more than once)."""
    mask = torch.ones(3, 32, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 27:] = 0
    q, k, v, sink, go = _inputs(*mask.shape, seed=2)
    real = mask.bool()
    for window in (None, 5):
        want = _grads(lambda q, k, v, s: sink_reference(q, k, v, _allowed(mask, window), s), (q, k, v, sink),
                      go, real)
        case = dict(q=q, k=k, v=v, sink=sink, go=go, mask=mask, window=window, packed=packed)
        results = helpers.run_ranks(rank_cp_sinks, 2, case, timeout=200)
        b, s, h, d = q.shape
        for name in ("allgather", "ring"):
            out = torch.zeros(b * s, h, d)
            dq = torch.zeros(b * s, h, d)
            for r in results:
                mine, got = r[name]["mine"], r[name]
                keep = mine >= 0
                out[mine[keep]] = got["out"].reshape(-1, h, d)[keep]
                dq[mine[keep]] = got["dq"].reshape(-1, h, d)[keep]
            flat_real = real.reshape(-1)
            assert (out[flat_real] - want[0].reshape(-1, h, d)[flat_real]).abs().max() < 1e-5, (name, window)
            assert (dq[flat_real] - want[1].reshape(-1, h, d)[flat_real]).abs().max() < 1e-5, (name, window)
            assert (results[0][name]["dsink"] - want[4]).abs().max() < 1e-5, (name, window)
