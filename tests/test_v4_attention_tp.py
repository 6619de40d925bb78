"""DeepSeek-V4's attention at tp 2 (two gloo ranks): heads, sinks and output groups split, the rest replicated;
padded, packed, and packed + sequence parallelism, on sliding / CSA / HCA layers, against transformers on each
row alone (outputs, input and parameter gradients). Without sequence parallelism every replicated parameter's
gradient is whole on every rank; under it, each rank's is a partial sum (the weight table's ``tp_sum="sp"``),
summed here as finalize_grads does."""

from __future__ import annotations

import helpers
import pytest
import torch
import v4_attention_cases as cases

TOL = 1e-5
LENGTHS = [16, 11, 13]
RUNS = [(kind, packed, sp) for kind in ("sliding", "hca", "csa")
        for packed, sp in ((False, False), (True, False), (True, True))]


def tp2_rank(rank, world, runs):
    import parallm
    parallm.init_parallel(tp=2)
    try:
        out = []
        for spec, state, layer, x, r, packed, sp in runs:
            o, gx, grads, ctx = cases.run(spec, state, layer, x, LENGTHS, r, packed=packed, tp=2, rank=rank, sp=sp)
            out.append((o, gx, grads))
        return out
    finally:
        parallm.destroy_parallel()


def _gather_sp(parts, ctx):
    from parallm.model.layers.attention import unpack_tokens
    return unpack_tokens(torch.cat(parts, 0)[:, 0], ctx).transpose(0, 1)


@pytest.mark.timeout(300)
def test_tp2_matches_transformers():
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(LENGTHS), 16, cfg.hidden_size, generator=g)
    r = torch.randn(len(LENGTHS), 16, cfg.hidden_size, generator=g)
    refs, runs = {}, []
    for kind in ("sliding", "hca", "csa"):
        refs[kind] = cases.hf_reference(cases.hf_layer(cfg, kind), cfg, x, LENGTHS, r)
    for kind, packed, sp in RUNS:
        runs.append((spec, refs[kind][3], cases.LAYER[kind], x, r, packed, sp))
    per_rank = helpers.run_ranks(tp2_rank, 2, runs)
    from parallm.model.layers.attention import make_packing
    mask = torch.arange(16)[None] < torch.tensor(LENGTHS)[:, None]
    worst = 0.0
    for k, (kind, packed, sp) in enumerate(RUNS):
        (o0, g0, p0), (o1, g1, p1) = per_rank[0][k], per_rank[1][k]
        if sp:
            ctx = make_packing(mask, 2)
            out, gx = _gather_sp([o0, o1], ctx), _gather_sp([g0, g1], ctx)
            p0 = {n: (g + p1[n] if n not in cases.SPLIT0 + cases.SPLIT1 else g) for n, g in p0.items()}
            p1 = {n: (g if n in cases.SPLIT0 + cases.SPLIT1 else p0[n]) for n, g in p1.items()}
        else:
            assert cases.max_err(o0, o1) == 0.0 and cases.max_err(g0, g1) == 0.0
            out, gx = o0, g0
            for n in p0:                       # replicated gradients: whole (and equal) on every rank
                if n not in cases.SPLIT0 + cases.SPLIT1:
                    assert cases.max_err(p0[n], p1[n]) <= 1e-6, (kind, packed, n)
        grads = cases.merge_grads([p0, p1], 2)
        r_out, r_gx, r_grads, _ = refs[kind]
        errs = {"out": cases.max_err(out, r_out, mask), "x.grad": cases.max_err(gx, r_gx, mask)}
        errs.update({n: cases.max_err(grads[n], r_grads[n]) for n in grads})
        assert sorted(grads) == sorted(n for n in r_grads if not n.startswith("indexer."))
        assert max(errs.values()) <= TOL, (kind, packed, sp, errs)
        worst = max(worst, max(errs.values()))
    print(f"tp2 worst error {worst:.2e}")


def refuse_rank(rank, world):
    import parallm
    parallm.init_parallel(tp=2)
    try:
        cfg = cases.hf_config(heads=4, o_groups=1)
        with pytest.raises(ValueError, match="o_groups=1 must be divisible by tp=2"):
            cases.build(cases.parallm_spec(cfg), {}, 0, tp=2, rank=rank)
        return True
    finally:
        parallm.destroy_parallel()


@pytest.mark.timeout(120)
def test_tp_must_divide_groups():
    assert all(helpers.run_ranks(refuse_rank, 2))
