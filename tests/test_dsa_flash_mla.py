"""The sparse attention's FlashMLA path at real TP sizes, on CPU with the kernel emulated (no GPU has run it):

* ``flash_mla_sparse`` pads the heads of a rank (16 at tp 4 of GLM-5's 64; 160, more than 128) with zero heads to
  64 / 128 a call and the top-k to a multiple of 64 with empty slots (-1), calls FlashMLA with the shapes its
  ``flash_mla_sparse_fwd`` takes (``q [T, 64 | 128, D]`` bf16, ``kv [N, 1, D]``, ``indices [T, 1, k]`` int32) and
  returns the real heads: equal to the torch kernel, forward and backward;
* where it cannot run (value width not 512, fp32, no package) it falls back to the torch kernel with one warning
  naming why, and the layer records the kernel that ran (``kernel_ran``).
"""

from __future__ import annotations

import warnings

import pytest
import torch


def _fake(calls):
    """flash_mla_sparse_fwd emulated by the torch kernel, checking the call's shapes."""
    from parallm.model.layers import dsa

    def fwd(q, kv, indices, scale, d_v=512):
        assert q.dtype == torch.bfloat16 and q.is_contiguous() and q.shape[1] in (64, 128), q.shape
        assert kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] in (512, 576), kv.shape
        assert indices.dtype == torch.int32 and indices.shape[1] == 1 and indices.shape[2] % 64 == 0
        calls.append((tuple(q.shape), tuple(indices.shape)))
        out = dsa.sparse_latent_attention(q, kv[:, 0], indices[:, 0], scale=scale, dv=d_v)
        return out, None, None
    return fwd


def _inputs(heads, topk, *, tokens=40, width=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, width, generator=g).bfloat16()
    kv = torch.randn(tokens, width, generator=g).bfloat16()
    index = torch.randint(0, tokens, (tokens, topk), generator=g, dtype=torch.int32)
    index[:, -3:] = -1                         # a few empty slots
    return q, kv, index


@pytest.mark.parametrize("heads,topk", [(16, 100), (64, 128), (160, 64)])
def test_heads_padded_and_equal_to_the_torch_kernel(monkeypatch, heads, topk):
    from parallm.model.layers import dsa
    calls = []
    monkeypatch.setattr(dsa, "_flash_mla_sparse_fwd", _fake(calls))
    monkeypatch.setattr(dsa, "FLASH_MLA_DEVICE", "cpu")
    q, kv, index = _inputs(heads, topk)
    results = []
    for kernel in (dsa.sparse_latent_attention, dsa.flash_mla_sparse):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")                   # FlashMLA runs: no fallback warning
            out = kernel(qq, kk, index, scale=0.1, dv=512)
        out.float().square().sum().backward()
        results.append((out.detach(), qq.grad, kk.grad))
    padded_heads = 64 if heads <= 64 else 128
    slices = 1 if heads <= 128 else -(-heads // 128)
    assert calls == [((40, padded_heads, 576), (40, 1, -(-topk // 64) * 64))] * slices
    (o1, dq1, dkv1), (o2, dq2, dkv2) = results
    assert o2.shape == o1.shape == (40, heads, 512)
    assert (o2.float() - o1.float()).abs().max() <= 1e-2 * o1.float().abs().max()   # bf16 outputs: one rounding
    assert torch.equal(dq1, dq2) or (dq1.float() - dq2.float()).abs().max() <= 1e-2 * dq1.float().abs().max()
    assert (dkv1.float() - dkv2.float()).abs().max() <= 1e-2 * dkv1.float().abs().max()


def test_the_pad_heads_are_discarded(monkeypatch):
    """A kernel that writes garbage into the padded heads changes nothing the caller sees."""
    from parallm.model.layers import dsa
    calls = []
    good = _fake(calls)

    def noisy(q, kv, indices, scale, d_v=512):
        out = good(q, kv, indices, scale, d_v)[0].clone()
        out[:, 16:] = 1e4
        return out, None, None
    monkeypatch.setattr(dsa, "_flash_mla_sparse_fwd", noisy)
    monkeypatch.setattr(dsa, "FLASH_MLA_DEVICE", "cpu")
    q, kv, index = _inputs(16, 64)
    got = dsa.flash_mla_sparse(q, kv, index, scale=0.1, dv=512)
    want = dsa.sparse_latent_attention(q, kv, index, scale=0.1, dv=512)
    assert got.shape == want.shape and got.float().abs().max() < 1e3


def test_fallback_warns_once_and_the_layer_records_it(monkeypatch, world_of_one):
    from parallm.model.layers import dsa
    from test_dsa_parts import _batch, _hf_attention, glm5_config, run_dsa
    calls = []
    monkeypatch.setattr(dsa, "_flash_mla_sparse_fwd", _fake(calls))
    monkeypatch.setattr(dsa, "FLASH_MLA_DEVICE", "cpu")
    monkeypatch.setattr(dsa, "_warned", set())
    q, kv, index = _inputs(16, 64, width=192)            # a value width of 128: FlashMLA cannot take it
    with pytest.warns(UserWarning, match="falls back to 'torch'.*kv_lora_rank 512"):
        out = dsa.flash_mla_sparse(q, kv, index, scale=0.1, dv=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # once per reason
        again = dsa.flash_mla_sparse(q, kv, index, scale=0.1, dv=128)
    assert calls == [] and torch.equal(out, again)
    assert torch.equal(out, dsa.sparse_latent_attention(q, kv, index, scale=0.1, dv=128))
    # the layer: "flash-mla" chosen, fp32 and a small latent: the torch kernel ran, and it says so
    from parallm.families import spec_from_config
    from parallm.model.layers import dsa as layer_module
    cfg = glm5_config()
    spec, _ = spec_from_config(cfg)
    x, _, mask, r = _batch(cfg.hidden_size)
    state = _hf_attention("glm_moe_dsa", cfg, x, mask, r)[0]
    built = []
    original = layer_module.DSAttention.__init__

    def init(self, *a, **kw):
        original(self, *a, **kw)
        self.kernel = "flash-mla"
        built.append(self)
    monkeypatch.setattr(layer_module.DSAttention, "__init__", init)
    with pytest.warns(UserWarning, match="FlashMLA runs on CUDA in bf16"):
        run_dsa(spec, state, x, mask, r, packed=False)
    assert built[0].kernel == "flash-mla" and built[0].kernel_ran == "torch"
