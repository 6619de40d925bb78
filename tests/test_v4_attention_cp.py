"""DeepSeek-V4's attention under context parallelism (cp 2, two gloo ranks; and cp 2 x tp 2 on four): each rank
holds two zigzag chunks of every row / document (parallm.model.context_parallel.split_batch), the key stream's
tokens are all-gathered over the CP group in global order (compressor pools, sliding windows and the indexer's
entries span the chunks), gradients summed back onto their owners. Against transformers on each row alone:
outputs, input gradients and parameter gradients (summed over the CP ranks, as the data-parallel reduction over
dp x cp does), padded and packed, sliding / CSA / HCA."""

from __future__ import annotations

import helpers
import pytest
import torch
import v4_attention_cases as cases

TOL = 1e-5
LENGTHS = [16, 11, 13]
RUNS = [(kind, packed) for kind in ("sliding", "hca", "csa") for packed in (False, True)]


def run_cp(spec, state, layer, x, r, packed, sp=False, *, cp, tp, cp_rank, tp_rank, cp_group):
    from parallm.model.context_parallel import split_batch
    b, s, h = x.shape
    mask = torch.arange(s)[None] < torch.tensor(LENGTHS)[:, None]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    split = split_batch(torch.zeros(b, s, dtype=torch.long), pos, mask.long(), cp=cp, rank=cp_rank, packed=packed,
                        multiple=tp if sp else 1)
    attn = cases.build(spec, state, layer, tp=tp, rank=tp_rank, sp=sp, cp_group=cp_group)
    origin = split.origin.view(cp, split.rows, split.width)[cp_rank]                  # [rows, width]
    real = (origin >= 0)[..., None].float()
    xs = (x.reshape(b * s, h)[origin.clamp(min=0)] * real).detach().requires_grad_()
    rs = r.reshape(b * s, h)[origin.clamp(min=0)] * real
    if sp:                      # this TP rank's share of the local stream
        share = slice(tp_rank * split.rows // tp, (tp_rank + 1) * split.rows // tp)
        xs, rs, real, origin = xs[share].detach().requires_grad_(), rs[share], real[share], origin[share]
    out = attn(xs, None, None, split)
    (out * rs).sum().backward()
    grads = {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}
    return out.detach() * real, xs.grad * real, grads, origin


def cp_rank_fn(rank, world, runs, tp):
    import parallm
    from parallm.parallel.state import current_dims
    parallm.init_parallel(tp=tp, cp=world // tp)
    try:
        dims = current_dims()
        return dims.tp_rank, dims.cp_rank, [run_cp(*run, cp=world // tp, tp=tp, cp_rank=dims.cp_rank,
                                                   tp_rank=dims.tp_rank, cp_group=dims.cp_group) for run in runs]
    finally:
        parallm.destroy_parallel()


def _assemble(per_rank, k, shape, tp, sp=False):
    """Full ``[B, S, H]`` output / x grad from the ranks' slots; parameter grads: each CP rank's TP shards
    merged, then summed over CP."""
    out, gx = torch.zeros(shape), torch.zeros(shape)
    flat_o, flat_g = out.view(-1, shape[-1]), gx.view(-1, shape[-1])
    for _, _, res in per_rank:
        o, g, _, origin = res[k]
        keep = origin >= 0
        flat_o[origin[keep]] = o[keep]
        flat_g[origin[keep]] = g[keep]
    grads = None
    for c in sorted({cr for _, cr, _ in per_rank}):
        shards = [res[k][2] for _, cr, res in sorted(per_rank, key=lambda t: t[0]) if cr == c]
        merged = cases.merge_grads(shards, tp)
        if sp:                  # replicated gradients: partial over TP (tp_sum="sp"), summed as finalize_grads does
            merged = {n: (g if n in cases.SPLIT0 + cases.SPLIT1 else sum(sh[n] for sh in shards))
                      for n, g in merged.items()}
        grads = merged if grads is None else {n: grads[n] + merged[n] for n in grads}
    return out, gx, grads


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_cp2_matches_transformers(tp, sp):
    """cp 2 (tp 1), cp 2 x tp 2, and cp 2 x tp 2 with sequence parallelism (packed only: each TP rank holds half
    of its CP rank's stream)."""
    cfg = cases.hf_config()
    spec = cases.parallm_spec(cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(LENGTHS), 16, cfg.hidden_size, generator=g)
    r = torch.randn(len(LENGTHS), 16, cfg.hidden_size, generator=g)
    refs = {kind: cases.hf_reference(cases.hf_layer(cfg, kind), cfg, x, LENGTHS, r) for kind in cases.LAYER}
    todo = [(kind, packed) for kind, packed in RUNS if packed or not sp]
    runs = [(spec, refs[kind][3], cases.LAYER[kind], x, r, packed, sp) for kind, packed in todo]
    per_rank = helpers.run_ranks(cp_rank_fn, 2 * tp, runs, tp, timeout=360)
    mask = torch.arange(16)[None] < torch.tensor(LENGTHS)[:, None]
    worst = 0.0
    for k, (kind, packed) in enumerate(todo):
        out, gx, grads = _assemble(per_rank, k, tuple(x.shape), tp, sp)
        r_out, r_gx, r_grads, _ = refs[kind]
        errs = {"out": cases.max_err(out, r_out, mask), "x.grad": cases.max_err(gx, r_gx, mask)}
        errs.update({n: cases.max_err(grads[n], r_grads[n]) for n in grads})
        assert max(errs.values()) <= TOL, (kind, packed, errs)
        worst = max(worst, max(errs.values()))
    print(f"cp2 tp{tp} sp={sp} worst error {worst:.2e}")
