"""Expert LoRA on the grouped GEMM for any rank (no process group): the rank zero-padded to 16 bytes inside the
grouped kernel gives the loop's result, forward and backward, and keeps the grouped kernel."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype,r", [(torch.bfloat16, 4), (torch.bfloat16, 12), (torch.float32, 2),
                                     (torch.float32, 8)])
def test_expert_lora_delta_pads_the_rank_for_the_grouped_gemm(monkeypatch, dtype, r):
    from parallm.model.layers import lora
    e, h, out = 3, 32, 48
    counts = [5, 0, 7]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(sum(counts), h, generator=g).to(dtype)
    a0 = torch.randn(e, r, h, generator=g).to(dtype)
    b0 = torch.randn(e, out, r, generator=g).to(dtype)
    go = torch.randn(sum(counts), out, generator=g).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    kinds = []
    real = lora._gmm
    monkeypatch.setattr(lora, "_gmm", lambda x, w, c, o, grouped: kinds.append(grouped) or real(x, w, c, o, grouped))

    def run(grouped):
        x, a, b = (t.clone().requires_grad_() for t in (x0, a0, b0))
        y = lora.expert_lora_delta(x, a, b, counts, offsets, grouped)
        (y.float() * go.float()).sum().backward()
        return [t.float() for t in (y.detach(), x.grad, a.grad, b.grad)]

    loop = run(False)
    assert kinds == [False, False]
    kinds.clear()
    fast = run(True)
    assert kinds == [True, True]                  # the grouped kernel, whatever the rank
    tol = 1e-6 if dtype == torch.float32 else 2e-2    # padding changes the GEMM blocking: fp32 rounding only
    for name, got, want in zip(("out", "dx", "dA", "dB"), fast, loop):
        assert got.shape == want.shape, name
        scale = want.abs().max().clamp(min=1)
        assert ((got - want).abs().max() / scale) <= tol, (name, (got - want).abs().max())
