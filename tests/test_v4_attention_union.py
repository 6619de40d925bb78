"""The sparse kernel's union path (parallm.model.layers.sparse_union) and the CSA layer without its indexer where
no query sees more than index_topk entries: taken where intended, equal to the gathered path and to
transformers (fp32). Breaks that must fail: the union's per-query mask dropped (every query attending the whole
union), the indexer skipped where it selects."""

from __future__ import annotations

import pytest
import torch
import v4_attention_cases as cases

from parallm.model.layers import sparse_union
from parallm.model.layers.dsa import sparse_latent_attention

LENGTHS = [16, 11, 13]


def _kernel(q, kv, index, sink, grad, paths):
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out = sparse_latent_attention(leaves[0], leaves[1], index, scale=0.3, dv=6, sink=leaves[2], paths=paths)
    (out * grad).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _window_index(n: int, window: int, extra: int) -> torch.Tensor:
    """Each query's window of rows ``i - window < j <= i`` and the first ``(i + 1) // 4`` of ``extra`` rows
    after the ``n`` raw ones (V4's shape: overlapping windows, shared compressed rows), -1 elsewhere."""
    i = torch.arange(n)[:, None]
    win = i - torch.arange(window)
    ent = torch.arange(extra)
    ent = torch.where(ent < (i + 1) // 4, n + ent, -1)
    return torch.cat([torch.where(win >= 0, win, -1), ent], 1).to(torch.int32)


def test_union_blocks_equal_gathered_blocks():
    """The kernel (K = V wider than dv, a sink, a query that sees nothing) on a V4-shaped index: every block on
    the union path, values and q / kv / sink gradients equal to the gathered path's; an index whose unions are
    wide (random rows) or that names a row twice stays gathered."""
    g = torch.Generator().manual_seed(4)
    n, extra = 150, 37
    q, kv = torch.randn(n, 3, 8, generator=g), torch.randn(n + extra, 8, generator=g)
    sink, grad = torch.randn(3, generator=g), torch.randn(n, 3, 6, generator=g)
    index = _window_index(n, 40, extra)
    index[7] = -1
    paths = {}
    got = _kernel(q, kv, index, sink, grad, paths)
    want = _kernel(q, kv, index, sink, grad, None)
    assert paths == {"union": 3}, paths
    for a, b, name in zip(got, want, ("out", "q", "kv", "sink")):
        err = float((a - b).abs().max())
        assert err < 2e-6, (name, err)
    assert float(got[0][7].abs().max()) == 0.0
    wide = torch.randint(0, n + extra, (n, 4), generator=g, dtype=torch.int32)
    twice = index.clone()
    twice[:, 1] = twice[:, 0]
    for idx in (wide, twice):
        paths = {}
        got, want = _kernel(q, kv, idx, sink, grad, paths), _kernel(q, kv, idx, sink, grad, None)
        assert paths == {"gathered": 3}, paths
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _run_layer(monkeypatch, spec, state, kind, x, r, packed, lengths=LENGTHS):
    """cases.run, returning the built layer too (its ``paths``)."""
    built = []
    real_build = cases.build

    def build(*a, **k):
        built.append(real_build(*a, **k))
        return built[-1]
    monkeypatch.setattr(cases, "build", build)
    got = cases.run(spec, state, cases.LAYER[kind], x, lengths, r, packed=packed)
    monkeypatch.setattr(cases, "build", real_build)
    return got, built[0].paths


def _batch(h: int, s: int = 16, rows: int = len(LENGTHS)):
    g = torch.Generator().manual_seed(5)
    return torch.randn(rows, s, h, generator=g), torch.randn(rows, s, h, generator=g)


def _errs(a, b, lengths=LENGTHS):
    """The worst error over out, x.grad and every parameter gradient, each relative to the largest value of b's
    (parameter gradients sum over every token: their size grows with the batch)."""
    mask = torch.arange(a[0].shape[1])[None] < torch.tensor(lengths)[:, None]
    pairs = [(a[0][mask], b[0][mask]), (a[1][mask], b[1][mask])] + [(a[2][k], b[2][k]) for k in a[2]]
    return max(cases.max_err(x, y) / max(float(y.abs().max()), 1e-30) for x, y in pairs)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("packed", [False, True])
def test_union_path_taken_and_exact(world_of_one, monkeypatch, kind, packed):
    """V4-Flash's proportions (window 64 against blocks of 64 queries, rates 4 / 16, a top-k of 64 no query
    exceeds), one row of 256 tokens and one of 200, padded and packed: every block on the union path (the
    default ratio), no indexer run, equal to transformers and to the all-gathered kernel."""
    lengths = [256, 200]
    cfg = cases.hf_config(window=64, topk=64, csa_rate=4, hca_rate=16)
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size, 256, 2)
    ref = cases.hf_reference(cases.hf_layer(cfg, kind), cfg, x, lengths, r)
    got, paths = _run_layer(monkeypatch, spec, ref[3], kind, x, r, packed, lengths)
    assert set(paths) == {"union"}, paths   # no gathered block (padded: blocks by row), no indexer run
    monkeypatch.setattr(sparse_union, "UNION_RATIO", 0.0)     # every block gathered
    old, old_paths = _run_layer(monkeypatch, spec, ref[3], kind, x, r, packed, lengths)
    assert set(old_paths) == {"gathered"}, old_paths
    err_ref, err_old = _errs(got, ref, lengths), _errs(got, old, lengths)
    print(f"{kind} packed={packed}: {paths}; relative error vs transformers {err_ref:.2e} (the gathered "
          f"path's: {_errs(old, ref, lengths):.2e}), vs gathered {err_old:.2e}")
    assert err_ref <= 2e-6 and err_old <= 2e-6, (err_ref, err_old)


def test_union_path_on_tiny_windows(world_of_one, monkeypatch):
    """The union path forced (any ratio) on the tiny config of test_v4_attention (window 4, rows of 16 / 11 /
    13, padded: three rows interleaved in a block): equal to transformers on every kind."""
    monkeypatch.setattr(sparse_union, "UNION_RATIO", 1e9)
    cfg = cases.hf_config(topk=8)
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size)
    for kind in ("sliding", "hca", "csa"):
        ref = cases.hf_reference(cases.hf_layer(cfg, kind), cfg, x, LENGTHS, r)
        for packed in (False, True):
            got, paths = _run_layer(monkeypatch, spec, ref[3], kind, x, r, packed)
            assert set(paths) == {"union"}, paths
            assert _errs(got, ref) <= 2e-6, (kind, packed, _errs(got, ref))


def test_csa_indexer_runs_where_it_selects(world_of_one, monkeypatch):
    """index_topk 2 (below the 8 entries a late query sees): the indexer runs, equal to transformers; skipping
    it there (attending every visible entry) must move the output."""
    cfg = cases.hf_config(topk=2)
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size)
    ref = cases.hf_reference(cases.hf_layer(cfg, "csa"), cfg, x, LENGTHS, r)
    got, paths = _run_layer(monkeypatch, spec, ref[3], "csa", x, r, True)
    assert paths.get("indexer") == 1, paths
    assert _errs(got, ref) <= 2e-6
    wide = cases.parallm_spec(cases.hf_config(topk=8))           # the same weights, the indexer skipped
    skipped, paths = _run_layer(monkeypatch, wide, ref[3], "csa", x, r, True)
    assert "indexer" not in paths, paths
    assert cases.max_err(skipped[0], ref[0]) > 1e-3


def test_union_mask_dropped_fails(world_of_one, monkeypatch):
    """Break: every query of a union block attends the whole union (its own selection ignored)."""
    monkeypatch.setattr(sparse_union, "UNION_RATIO", 1e9)
    cfg = cases.hf_config(topk=8)
    spec = cases.parallm_spec(cfg)
    x, r = _batch(cfg.hidden_size)
    ref = cases.hf_reference(cases.hf_layer(cfg, "hca"), cfg, x, LENGTHS, r)
    real = sparse_union.union_of

    def broken(index):
        plan = real(index)
        return None if plan is None else (plan[0], torch.ones_like(plan[1]))
    monkeypatch.setattr("parallm.model.layers.dsa.union_of", broken)
    got, paths = _run_layer(monkeypatch, spec, ref[3], "hca", x, r, True)
    assert paths.get("union"), paths
    assert cases.max_err(got[0], ref[0]) > 1e-3
