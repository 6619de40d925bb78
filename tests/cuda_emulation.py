"""CPU stand-ins for the CUDA attention path's plumbing, shared by the tests and scripts/gpu_checks' --cpu runs:
aten's varlen flash forward / backward emulated in fp32, and a context-parallel split's local view of a batch."""
from __future__ import annotations

import torch


def local_slots(t, split):
    """``t`` [B, S, ...] -> this rank's slots [rows, width, ...] through the split's origin (zeros at padding)."""
    b, s = t.shape[:2]
    mine = split.origin[split.rank * split.slots:(split.rank + 1) * split.slots]
    flat = t.reshape(b * s, *t.shape[2:])
    keep = (mine >= 0).view(-1, *[1] * (t.dim() - 2))
    return torch.where(keep, flat[mine.clamp(min=0)], torch.zeros_like(flat[:1])).view(
        split.rows, split.width, *t.shape[2:])


def emulated_flash():
    """aten's varlen flash forward / backward emulated on CPU in fp32 with flash-attention's documented masks
    (bottom-right aligned: query i of Lq sees key j of Lk iff i + Lk - Lq - left <= j <= i + Lk - Lq + right,
    -1 / None unbounded; causal sets right = 0), the lse as [hq, total_q]: the CUDA kernel's plumbing (groups,
    indices, windows, lse layout) checked without a GPU."""
    from parallm.model.layers.blocks import _flash_window, block_backward, block_forward

    def masks(g, window):
        win = _flash_window(g, window)
        left, right = win["window_size_left"], win["window_size_right"]
        cu_q, cu_k = g.cu_q.tolist(), g.cu_k.tolist()
        for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
            lq, lk = b - a, e - c
            i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
            vis = torch.ones(lq, lk, dtype=torch.bool)
            if right is not None:
                vis &= j <= i + lk - lq + right
            if left is not None:
                vis &= j >= i + lk - lq - left
            add = torch.zeros(lq, lk).masked_fill(~vis, float("-inf"))[None, None]
            yield slice(a, b), slice(c, e), add

    def fwd(q, k, v, g, scale, window):
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.zeros(q.shape[1], q.shape[0])
        for qs, ks, add in masks(g, window):
            o, l = block_forward(*(t[s].float().transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))),
                                 False, scale, mask=add)
            out[qs] = o[0].transpose(0, 1)
            lse[:, qs] = l[0]
        return out.to(q.dtype), lse

    def bwd(grad, q, k, v, out, lse, g, scale, window):
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v))
        for qs, ks, add in masks(g, window):
            a, b, c = block_backward(*(t[s].float().transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks),
                                                                                      (out, qs))),
                                     lse[:, qs][None], grad[qs].float().transpose(0, 1)[None], False, scale,
                                     mask=add)
            dq[qs] += a[0].transpose(0, 1)
            dk[ks] += b[0].transpose(0, 1)
            dv[ks] += c[0].transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return fwd, bwd
