"""One tie rule for the DSA indexer's top-k (fp32, GLM-5 with 4 indexer heads, where a key whose every head's ReLU
is zero scores exactly 0 and exact ties at the top-k boundary are common):

* the selection of every real query is the same in the padded layout (rows full / left- / right- / both-sides
  padded) and in the packed stream, and equals transformers' own indexer run with the same rule (ties by the
  lower key position; transformers' ``torch.topk`` keeps arbitrary tied keys);
* ``parallm verify`` passes padded and packed on such a model (its reference follows the rule), and when the
  two sides break ties differently (parallm's rule reversed, a deliberate break) it fails and names the top-k
  near-tie in its notes.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from test_dsa_parts import (_batch, _hf_mask, _hf_modules, _load_indexer, _parallm_rope, _rows, _selections,
                            glm5_config)

HEADS = 4


def _packed_selections(index, packing, seq):
    """Packed selections [T, k] -> {(b, s): set of key positions in the padded row} for the real tokens."""
    out = {}
    flat = packing.indices.tolist()
    for t, where in enumerate(flat):
        b, s = divmod(where, seq)
        out[(b, s)] = {flat[int(g)] % seq for g in index[t] if g >= 0}
    return out


def test_packed_padded_and_reference_select_alike():
    from parallm.families import spec_from_config
    from parallm.model.layers.attention import PaddedRows, make_packing, pack_tokens
    from parallm.model.layers.indexer import Indexer, key_ranges
    from parallm.verify.ties import lowest_first_topk
    cfg = glm5_config(index_n_heads=HEADS)
    spec, _ = spec_from_config(cfg)
    hf_indexer, _, hf_rope = _hf_modules("glm_moe_dsa")
    ref = hf_indexer(cfg, 0)
    helpers.randomize_(ref, seed=5)
    x, q_resid, mask, _ = _batch(cfg.hidden_size)
    seq = mask.shape[1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    allowed, additive = _hf_mask(mask)
    with torch.no_grad():
        plain = ref(x, q_resid, hf_rope(cfg)(x, pos), additive[:, 0], pos)
        with lowest_first_topk(ref):
            ruled = ref(x, q_resid, hf_rope(cfg)(x, pos), additive[:, 0], pos)
    ours = Indexer(spec, torch.float32)
    _load_indexer(ours, ref.state_dict())
    cos, sin = _parallm_rope(spec, pos.transpose(0, 1))
    padded = _selections(ours.select(x.transpose(0, 1), q_resid.transpose(0, 1), cos, sin,
                                     key_ranges(PaddedRows(mask.bool()))), width=4)
    packing = make_packing(mask)
    pcos, psin = _parallm_rope(spec, pack_tokens(pos, packing)[:, None])
    packed = _packed_selections(ours.select(_rows(x, packing), _rows(q_resid, packing), pcos, psin,
                                            key_ranges(packing)), packing, seq)
    ties = differ = 0
    for (b, s), got in packed.items():
        visible = int(allowed[b, 0, s].sum())
        want = {int(j) for j in ruled[b, s] if allowed[b, 0, s, j]}
        assert got == padded[(b, s)] == want, (b, s, sorted(got), sorted(padded[(b, s)]), sorted(want))
        differ += want != {int(j) for j in plain[b, s] if allowed[b, 0, s, j]}
        ties += visible > 16
    assert ties > 200
    assert differ > 0          # transformers' own torch.topk kept other tied keys somewhere: the rule matters


def _verify_rank(rank, world, checks, reversed_rule):
    from parallm import verify
    from parallm.model.layers import indexer
    rows = [verify.check_layout(c) for c in checks]
    if reversed_rule:          # a deliberate break: ties by the higher key position on parallm's side only
        original = indexer.topk_lowest_first

        def highest_first(scores, mask, k, rev):
            return original(scores, mask, k, (1 << 32) - 1 - rev)
        indexer.topk_lowest_first = highest_first
        try:
            rows += [verify.check_layout(c) for c in checks]
        finally:
            indexer.topk_lowest_first = original
    return rows


@pytest.mark.timeout(240)
def test_verify_passes_both_layouts_and_names_a_near_tie(tmp_path):
    from parallm import verify
    cfg = glm5_config(index_n_heads=HEADS, index_topk=4)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=0), str(tmp_path / "glm"))
    checks = [verify.Check(ckpt, str(tmp_path / f"s{i}"), packed=packed, label="glm")
              for i, packed in enumerate((False, True))]
    broken = [verify.Check(ckpt, str(tmp_path / f"b{i}"), packed=packed, label="glm")
              for i, packed in enumerate((False, True))]
    rows = helpers.run_ranks(_verify_rank, 1, checks, False)[0]
    rows += helpers.run_ranks(_verify_rank, 1, broken, True)[0][2:]
    for row in rows:
        print(row["layout"], row["ok"], row["d_out"], row["d_after"], row["notes"])
    assert rows[0]["ok"] and rows[1]["ok"], rows[:2]
    assert not any("near-tie" in n for n in rows[0]["notes"] + rows[1]["notes"])
    for row in rows[2:]:
        assert not row["ok"]
        assert any("near-tie" in n and "layer" in n for n in row["notes"]), row["notes"]
