"""DeepSeek-V4's attention layer (parallm.model.layers.v4_attention) against transformers' ``DeepseekV4Attention``
on each row alone, fp32, weights copied: outputs, input and parameter gradients, on sliding / CSA / HCA layers,
padded (right padding) and packed; sinks that weigh; a CSA config where the indexer's top-k is smaller than what
most queries see; a YaRN compress rope. Breaks that must fail: the sink dropped, the compressor's windows
shifted by one position, the output's de-rotation skipped."""

from __future__ import annotations

import pytest
import torch
import v4_attention_cases as cases

TOL = 1e-5
LENGTHS = [16, 11, 13]


def _batch(h: int, seed: int = 5, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(LENGTHS), s, h, generator=g)
    r = torch.randn(len(LENGTHS), s, h, generator=g)
    return x, r


def _real_mask(s=16):
    return torch.arange(s)[None] < torch.tensor(LENGTHS)[:, None]


def _check(got, ref, what):
    out, gx, grads, _ = got
    r_out, r_gx, r_grads, _ = ref
    mask = _real_mask(out.shape[1])
    errs = {"out": cases.max_err(out, r_out, mask), "x.grad": cases.max_err(gx, r_gx, mask)}
    assert sorted(grads) == sorted(k for k in r_grads if not k.startswith("indexer.")), (sorted(grads),
                                                                                          sorted(r_grads))
    errs.update({k: cases.max_err(grads[k], r_grads[k]) for k in grads})
    weak = [k for k in grads if float(r_grads[k].abs().max()) < 1e-3]
    assert not weak, (what, weak)                 # every trained parameter's gradient is checked, none is ~0
    worst = max(errs.values())
    print(f"{what}: worst error {worst:.2e} ({max(errs, key=errs.get)})")
    assert worst <= TOL, (what, errs)
    return worst


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_transformers(world_of_one, kind, packed):
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    layer = cases.hf_layer(cfg, kind)
    x, r = _batch(cfg.hidden_size)
    ref = cases.hf_reference(layer, cfg, x, LENGTHS, r)
    got = cases.run(spec, ref[3], cases.LAYER[kind], x, LENGTHS, r, packed=packed)
    _check(got, ref, (kind, packed))


def test_yarn_compress_rope(world_of_one):
    """A YaRN compress rope (attention factor forced to 1, as transformers' V4 config does) on CSA and HCA."""
    cfg = cases.hf_config(yarn=True)
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0
    spec = cases.parallm_spec(cfg)
    for kind in ("csa", "hca"):
        layer = cases.hf_layer(cfg, kind)
        x, r = _batch(cfg.hidden_size)
        ref = cases.hf_reference(layer, cfg, x, LENGTHS, r)
        _check(cases.run(spec, ref[3], cases.LAYER[kind], x, LENGTHS, r, packed=True), ref, ("yarn", kind))


def _hf_index_scores(layer, cfg, x, n):
    """transformers' indexer scores ``[n, entries]`` (future entries -inf) of the first row's first n tokens."""
    idx = layer.compressor.indexer
    captured = {}
    hook = idx.scorer.register_forward_hook(lambda m, a, out: captured.setdefault("s", out))
    xb = x[:1, :n]
    pos = torch.arange(n)[None]
    with torch.no_grad():
        q_resid = layer.q_a_norm(layer.q_a_proj(xb))
        idx(xb, q_resid, pos, None, 0)
    hook.remove()
    scores = captured["s"][0]
    ent = torch.arange(scores.shape[-1])
    return scores.masked_fill(ent[None] >= ((torch.arange(n) + 1) // idx.compress_rate)[:, None], float("-inf"))


def test_csa_selection_matters_without_ties(world_of_one):
    """The premise of the CSA tests: top-k (2) is below the visible entries for most queries, with no tie at the
    cut (ReLU zeros make exact ties likely: a tie would let the tie rules differ); and a wider top-k (every
    visible entry) changes the output, so the selection is what the parity tests check."""
    cfg = cases.hf_config()
    layer = cases.hf_layer(cfg, "csa")
    x, r = _batch(cfg.hidden_size)
    for b, n in enumerate(LENGTHS):
        scores = _hf_index_scores(layer, cfg, x[b:b + 1], n)
        visible = torch.isfinite(scores).sum(-1)
        assert int((visible > cfg.index_topk).sum()) >= n // 2
        top = scores.sort(-1, descending=True).values
        cut = visible > cfg.index_topk
        k = cfg.index_topk
        gap = (top[cut, k - 1] - top[cut, k]).abs()
        assert float(gap.min()) > 1e-4, gap
    ref = cases.hf_reference(layer, cfg, x, LENGTHS, r)
    wide = cases.hf_config(topk=16)
    spec = cases.parallm_spec(wide)
    out = cases.run(spec, ref[3], cases.LAYER["csa"], x, LENGTHS, r, packed=False)[0]
    assert cases.max_err(out, ref[0], _real_mask()) > 1e-3


def _broken(monkeypatch, what):
    from parallm.model.layers import v4_attention, v4_layout
    if what == "sink dropped":
        kernel = v4_attention.sparse_latent_attention
        monkeypatch.setattr(v4_attention, "sparse_latent_attention",
                            lambda *a, sink=None, **k: kernel(*a, sink=None, **k))
    elif what == "pool shifted":
        make = v4_layout.V4Layout._make_entries

        def shifted(self, rate):
            e = make(self, rate)
            e.rows = (e.rows + self.stride[0]).clamp(max=self.keys - 1)
            return e
        monkeypatch.setattr(v4_layout.V4Layout, "_make_entries", shifted)
    elif what == "no de-rotation":
        rope = v4_attention.rope_tail
        calls = []

        def skip_third(x, cos, sin):
            calls.append(1)
            return x if len(calls) % 3 == 0 else rope(x, cos, sin)
        monkeypatch.setattr(v4_attention, "rope_tail", skip_third)


@pytest.mark.parametrize("what,kinds", [("sink dropped", ("sliding",)), ("pool shifted", ("hca", "csa")),
                                        ("no de-rotation", ("sliding", "hca"))])
def test_breaks_fail(world_of_one, monkeypatch, what, kinds):
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size)
    for kind in kinds:
        ref = cases.hf_reference(cases.hf_layer(cfg, kind), cfg, x, LENGTHS, r)
        with monkeypatch.context() as m:
            _broken(m, what)
            out = cases.run(spec, ref[3], cases.LAYER[kind], x, LENGTHS, r, packed=True)[0]
        assert cases.max_err(out, ref[0], _real_mask()) > 1e-3, (what, kind)


def test_sparse_kernel_sink_gradients():
    """The blocked sparse kernel with a sink (it computes in fp32) against a dense fp32 autograd reference:
    values and q / kv / sink gradients, blocks of two queries, empty slots and a query that sees nothing (zero
    output, only its sink's gradient... none: its output is zero whatever the sink)."""
    from parallm.model.layers.dsa import sparse_latent_attention
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 3, 8, generator=g)
    kv = torch.randn(10, 8, generator=g)
    sink = torch.randn(3, generator=g)
    grad = torch.randn(7, 3, 8, generator=g)
    index = torch.randint(0, 10, (7, 4), generator=g, dtype=torch.int32)
    index[1, 2:] = -1
    index[4] = -1

    def dense(q, kv, sink):
        rows = kv[index.clamp_min(0).long()]                                      # [7, 4, 8]
        s = torch.einsum("qhd,qkd->qhk", q, rows) * 0.3
        s = s.masked_fill((index < 0)[:, None, :], float("-inf"))
        logits = torch.cat([s, sink[None, :, None].expand(7, 3, 1)], -1)
        return torch.einsum("qhk,qkd->qhd", logits.softmax(-1)[..., :-1], rows)

    results = []
    for fn in (lambda a, b, c: sparse_latent_attention(a, b, index, scale=0.3, dv=8, sink=c, budget=64), dense):
        leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
        out = fn(*leaves)
        (out * grad).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for got, want, name in zip(results[0], results[1], ("out", "q", "kv", "sink")):
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (name, float((got - want).abs().max()))
    assert float(results[0][0][4].abs().max()) == 0.0
    assert float(results[0][3].abs().max()) > 1e-2           # the sinks' gradient is no zero


def test_no_square_tensor(world_of_one, monkeypatch):
    """S = 1024 on one row, CSA and HCA (rate 4: 256 entries a late query sees, so the HCA index made whole,
    S x (window + 256), would exceed the bound): the largest tensor any operation of the forward and backward
    makes stays below S * S / 8 elements (the kernel's and the indexer's blocks made small so that a square one
    would show)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallm.model.layers import dsa, indexer
    from parallm.model.layers.attention import Packing, make_packing
    monkeypatch.setattr(indexer, "SCORE_BUDGET", 1 << 15)
    monkeypatch.setattr(dsa, "GATHER_BUDGET", 1 << 15)
    cfg = cases.hf_config(topk=8, csa_rate=4, hca_rate=4, window=16)
    spec = cases.parallm_spec(cfg)
    s = 1024

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    for kind in ("csa", "hca"):
        state = {k: v for k, v in cases.hf_reference(cases.hf_layer(cfg, kind), cfg, torch.randn(1, 8, 32), [8],
                                                       torch.randn(1, 8, 32))[3].items()}
        attn = cases.build(spec, state, cases.LAYER[kind])
        ctx: Packing = make_packing(torch.ones(1, s, dtype=torch.bool))
        ctx.positions = torch.arange(s)[:, None]
        x = torch.randn(s, 1, cfg.hidden_size, requires_grad=True)
        Largest.biggest = 0
        with Largest():
            attn(x, None, None, ctx).sum().backward()
        assert Largest.biggest < s * s // 8, (kind, Largest.biggest)
    from parallm.model.layers.v4_layout import V4Index, v4_layout
    whole = V4Index(v4_layout(ctx), cfg.sliding_window, rate=4).shape
    assert whole[0] * whole[1] > s * s // 8, whole             # the bound would catch a whole HCA index


def test_bf16_close_to_transformers(world_of_one):
    """bf16 (the fp32-kept parameters fp32 on both sides: sinks, position biases, norms): parallm's output
    within bf16 rounding of transformers' (which attends in bf16 where parallm accumulates in fp32), on every
    kind, packed; and far from it with the sinks dropped (the tolerance is not vacuous)."""
    from parallm.model.decoder import make_config
    from parallm.model.layers.attention import make_packing, pack_tokens, unpack_tokens
    from parallm.model.layers.v4_attention import V4Attention
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    x, _ = _batch(cfg.hidden_size)
    mask = _real_mask()
    ctx = make_packing(mask)
    ctx.positions = pack_tokens((mask.long().cumsum(-1) - 1).clamp(min=0), ctx)[:, None]
    xs = torch.stack([pack_tokens(x[..., k], ctx) for k in range(x.shape[-1])], -1)[:, None].bfloat16()
    keep32 = ("sinks", "position_bias", "q_a_norm", "kv_norm")
    for kind in cases.LAYER:
        layer = cases.hf_layer(cfg, kind)
        for name, p in layer.named_parameters():
            if not any(k in name for k in keep32):
                p.data = p.data.bfloat16()
        rotary = DeepseekV4RotaryEmbedding(cfg)
        want = torch.zeros(x.shape, dtype=torch.bfloat16)
        with torch.no_grad():
            for b, n in enumerate(LENGTHS):
                xb, pos = x[b:b + 1, :n].bfloat16(), torch.arange(n)[None]
                emb = {t: rotary(xb, pos, layer_type=t) for t in ("main", "compress")}
                want[b, :n] = layer(xb, emb, pos, cases.hf_mask(n, cfg.sliding_window).bfloat16())[0][0]
        state = {cases.RENAMES.get(k, k): v for k, v in layer.state_dict().items()}
        attn = V4Attention(spec, make_config(tp=1, pp=1, vpp=None, dtype=torch.bfloat16, sequence_parallel=False), 1,
                           layer_number=cases.LAYER[kind])
        with torch.no_grad():
            for name, p in attn.named_parameters():
                assert p.dtype == (torch.float32 if any(k in name for k in keep32) else torch.bfloat16), name
                p.copy_(state[name])
            got = unpack_tokens(attn(xs, None, None, ctx)[:, 0], ctx).transpose(0, 1)
            attn.sinks.fill_(-1e4)
            unsunk = unpack_tokens(attn(xs, None, None, ctx)[:, 0], ctx).transpose(0, 1)
        scale = float(want[mask].float().abs().max())
        err = cases.max_err(got.float(), want.float(), mask) / scale
        print(f"bf16 {kind}: relative error {err:.2e}")
        assert err < 2e-2, (kind, err)
        assert cases.max_err(unsunk.float(), want.float(), mask) / scale > 5 * err, kind


def test_refusals(world_of_one):
    """Left padding (transformers pools such a row from its padding on) and a missing ctx.positions are refused
    with the numbers."""
    from parallm.model.layers.attention import PaddedRows
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    state = cases.hf_reference(cases.hf_layer(cfg, "hca"), cfg, torch.randn(1, 4, 32), [4], torch.randn(1, 4, 32))[3]
    attn = cases.build(spec, state, cases.LAYER["hca"])
    keep = torch.tensor([[True, True, True, True], [False, True, True, True]])
    ctx = PaddedRows(keep)
    ctx.positions = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"right padding .*rows \[1\]"):
        attn(torch.randn(4, 2, 32), None, None, ctx)
    ctx = PaddedRows(torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="ctx.positions"):
        attn(torch.randn(4, 2, 32), None, None, ctx)


def test_sgd_step_leaves_the_indexer(world_of_one):
    """A CSA layer's training step (SGD over every parameter): the indexer (and its compressor) unchanged, bit
    for bit, the rest moved."""
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size)
    state = cases.hf_reference(cases.hf_layer(cfg, "csa"), cfg, x, LENGTHS, r)[3]
    from parallm.model.layers.attention import make_packing, pack_tokens
    attn = cases.build(spec, state, cases.LAYER["csa"])
    before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    mask = _real_mask()
    ctx = make_packing(mask)
    ctx.positions = pack_tokens((mask.long().cumsum(-1) - 1).clamp(min=0), ctx)[:, None]
    xs = torch.stack([pack_tokens(x[..., k], ctx) for k in range(x.shape[-1])], -1)[:, None]
    opt = torch.optim.SGD(attn.parameters(), lr=0.1)
    attn(xs, None, None, ctx).square().sum().backward()
    opt.step()
    for n, p in attn.named_parameters():
        same = torch.equal(p, before[n])
        assert same == n.startswith("indexer."), n
