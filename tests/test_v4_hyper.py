"""DeepSeek-V4's hyper-connections (parallm.model.layers.hyper_connections) against transformers 5.25's
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and the decoder layer's mixing, fp32: outputs and gradients
of inputs and parameters; a Sinkhorn count off by one is caught."""

from __future__ import annotations

import pytest
import torch

from parallm.model.layers.hyper_connections import HyperConnection, HyperHead, expand_streams, mix_streams

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

H, N = 16, 3


def _config(**kw):
    return transformers.DeepseekV4Config(hidden_size=H, hc_mult=N, hc_sinkhorn_iters=kw.get("iters", 5),
                                         hc_eps=1e-6, rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=8,
                                         num_attention_heads=2, head_dim=8, q_lora_rank=4, o_groups=1,
                                         o_lora_rank=4, n_routed_experts=2, num_experts_per_tok=1)


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _pair(iters=5, parallm_iters=None):
    ref = v4.DeepseekV4HyperConnection(_config(iters=iters)).float()
    _randomise(ref, 1)
    ours = HyperConnection(H, N, sinkhorn_iters=parallm_iters or iters, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            getattr(ours, name).copy_(getattr(ref, name))
    return ref, ours


def _streams(seed=2):
    return torch.randn(2, 5, N, H, generator=torch.Generator().manual_seed(seed))


def test_hyper_connection_equals_transformers():
    ref, ours = _pair()
    x_ref = _streams().requires_grad_()
    x_ours = x_ref.detach().clone().requires_grad_()
    outs_ref, outs_ours = ref(x_ref), ours(x_ours)
    for a, b in zip(outs_ref, outs_ours):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # the block output spread back and the streams mixed, as DeepseekV4DecoderLayer does it
    block = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    post, comb, _ = outs_ref
    mixed_ref = post.unsqueeze(-1) * block.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x_ref)
    mixed_ours = mix_streams(x_ours, block, outs_ours[0], outs_ours[1])
    torch.testing.assert_close(mixed_ours, mixed_ref, rtol=0, atol=1e-6)
    w = torch.randn(mixed_ref.shape, generator=torch.Generator().manual_seed(4))
    ((mixed_ref * w).sum() + (outs_ref[2] ** 2).sum()).backward()
    ((mixed_ours * w).sum() + (outs_ours[2] ** 2).sum()).backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-5)
    for name in ("fn", "base", "scale"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(ref, name).grad, rtol=0, atol=1e-5)


def test_sinkhorn_iterations_off_by_one_is_caught():
    ref, ours = _pair(iters=3, parallm_iters=4)
    x = _streams()
    diff = (ref(x)[1] - ours(x)[1]).abs().max().item()
    assert diff > 1e-4, f"one Sinkhorn step more changed comb by only {diff:.2e}: the parity test could not see it"


def test_hyper_head_equals_transformers():
    ref = v4.DeepseekV4HyperHead(_config()).float()
    _randomise(ref, 5)
    ours = HyperHead(H, N, eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        for name in ("hc_fn", "hc_base", "hc_scale"):
            getattr(ours, name).copy_(getattr(ref, name))
    x_ref = _streams(6).requires_grad_()
    x_ours = x_ref.detach().flatten(-2).clone().requires_grad_()
    out_ref, out_ours = ref(x_ref), ours(x_ours)
    torch.testing.assert_close(out_ours, out_ref, rtol=0, atol=1e-6)
    out_ref.pow(2).sum().backward()
    out_ours.pow(2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad.flatten(-2), rtol=0, atol=1e-5)
    for name in ("hc_fn", "hc_base", "hc_scale"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(ref, name).grad, rtol=0, atol=1e-5)


def test_expand_streams_copies_the_embedding():
    x = torch.randn(4, 2, H)
    out = expand_streams(x, N)
    assert out.shape == (4, 2, N * H)
    torch.testing.assert_close(out.unflatten(-1, (N, H)), x.unsqueeze(-2).expand(4, 2, N, H), rtol=0, atol=0)
