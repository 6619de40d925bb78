"""Nemotron-H with ``use_bias: true`` (``in_proj`` has a bias) and left-padded rows, one gloo rank, fp32.

parallm computes every row alone, as vLLM and every packed layout do: its logits at a row's real tokens equal
transformers' on that row run by itself, unpadded (padded build, which packs inside, and packed build; rows
full, left-, right- and both-sides padded). transformers' own padded forward differs on a left-padded row: it
zeroes the input at padded positions and then applies ``in_proj``, so its conv reads ``in_proj.bias`` from the
padded positions before the row (checked here as the documented difference: > 1e-3 on the left-padded rows,
nothing on the others). Without the bias the two agree.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_nemotron_h import make_model, nemotron_config

TOL = 2e-5


def _alone(model, ids, mask):
    """transformers' logits per row, each row's real tokens run alone (batch 1, no padding), placed back at their
    positions ([B, S, V], zeros at padded positions)."""
    from parallm.verify.reference import hf_output
    out = None
    with torch.no_grad():
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            one = hf_output(model, ids[b:b + 1, real], torch.ones(1, int(real.sum()), dtype=mask.dtype))
            if out is None:
                out = one.new_zeros(ids.shape + (one.shape[-1],))
            out[b, real] = one[0]
    return out


@pytest.mark.parametrize("use_bias", [True, False])
def test_rows_alone(world_of_one, tmp_path, use_bias):
    import parallm
    from parallm.verify.reference import hf_output
    cfg = nemotron_config("M*M-", use_bias=use_bias)
    model = make_model(cfg, seed=4)
    assert any(n.endswith("in_proj.bias") for n, _ in model.named_parameters()) == use_bias
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "nemo"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=21, seed=5)   # full, left, right, both sides
    left = [b for b in range(4) if not mask[b, 0]]
    assert left
    alone = _alone(model, ids, mask)
    with torch.no_grad():
        padded_hf = hf_output(model, ids, mask)
    for packed in (False, True):
        chunks = parallm.build_model(ckpt, packed=packed)
        parallm.load_hf_weights(chunks, ckpt)
        out = parallm.forward(chunks, ids, mask)
        for b in range(4):
            d = helpers.max_diff_real(out[b:b + 1], alone[b:b + 1], mask[b:b + 1])
            print(f"parallm packed={packed} vs alone, row {b}: {d:.3g}")
            assert d < TOL, (packed, b, d)
    # transformers' padded forward: the left-padded rows read in_proj.bias from the padding (use_bias only)
    for b in range(4):
        d = helpers.max_diff_real(padded_hf[b:b + 1], alone[b:b + 1], mask[b:b + 1])
        if use_bias and b in left:
            print(f"transformers padded vs alone, row {b}: {d:.3g}")
            assert d > 1e-3, (b, d)
        else:
            assert d < TOL, (b, d)
