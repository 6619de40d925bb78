"""Gemma 3 text (``Gemma3ForCausalLM``) against transformers 5.25 in fp32: the exact reference for the pieces Gemma 4
shares with it (sandwich norms, RoPE per layer type, the softmax scale, scaled embeddings, the tanh GELU, final
logit soft-capping, tied embeddings; docs/families.md).

The tiny model switches every feature on: 4 layers sliding / full / sliding / full (window 4 over rows of 12),
full layers linear-scaled RoPE theta 1e6, sliding ones default theta 1e4, ``query_pre_attn_scalar`` 24 (not
head_dim 16), soft-cap 0.5 (logits of std ~0.6), every norm's weight non-trivial (zero-centred: gains ``1 + w`` around 1).

Without a process group: config -> spec (a 4.x-style config.json too), the refusals by name, the table against
``save_pretrained``'s names. One 2-rank spawn: tp2 padded (logits, log-probs, entropy, bit-exact save, SGD step),
tp2 packed + SP (log-probs + entropy and a step on them), pp2 with 2 microbatches, cp2 packed. Breaks at tp2 and
pp2, each must move the logits: the attention's output norm skipped, every layer on the full layers' RoPE, the
cap off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers
import layout_harness

TOL = 2e-5
SEQ = 12
GEMMA3 = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=101, sliding_window=4, query_pre_attn_scalar=24, final_logit_softcapping=0.5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              bos_token_id=None, eos_token_id=None)


def gemma3_config(**overrides):
    import transformers
    return transformers.Gemma3TextConfig(**dict(GEMMA3, **overrides))


def make_model(seed: int):
    import transformers
    model = transformers.Gemma3ForCausalLM(gemma3_config())
    helpers.randomize_(model, seed=seed)
    with torch.no_grad():       # norms "around 1" for Gemma's zero-centred weights: gains 1 + w around 1, not 2
        for name, p in model.named_parameters():
            if "norm" in name:
                p -= 1.0
    return model.eval()


# -- no process group ----------------------------------------------------------------------------------------

def test_config_table_and_refusals(tmp_path):
    import json
    import os

    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    spec, family = spec_from_config(gemma3_config())
    assert family.name == "gemma3" and spec.sandwich_norms and spec.qk_norm and spec.zero_centered_norm
    assert spec.layer_windows == (4, None, 4, None) and spec.tie_word_embeddings and spec.pad_token_id == 0
    assert spec.rope.kind == "linear" and spec.rope.theta == 1e6
    assert [spec.layer_rope(i).theta for i in range(4)] == [1e4, 1e6, 1e4, 1e6]
    assert spec.attn_scale == 24 ** -0.5 and spec.embed_scale == 8.0 and spec.final_logit_softcap == 0.5
    assert spec.hidden_act == "gelu_pytorch_tanh"
    hub = helpers.hub_state_dict(make_model(0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    # a 4.x-style config.json: rope_theta / rope_local_base_freq at the top, no layer_types, defaults left out
    raw = json.loads(open(os.path.join(tmp_path, "m", "config.json")).read())
    for key in ("rope_parameters", "layer_types", "query_pre_attn_scalar", "tie_word_embeddings"):
        raw.pop(key, None)
    raw.update(rope_theta=5e5, rope_local_base_freq=2e4, num_hidden_layers=7)
    old, _ = spec_from_config(raw)
    assert old.rope.theta == 5e5 and old.rope.kind == "default" and old.attn_scale == 256 ** -0.5
    assert [old.layer_rope(i).theta for i in range(7)] == [2e4] * 5 + [5e5, 2e4]
    assert old.layer_windows == (4,) * 5 + (None, 4) and old.tie_word_embeddings
    for bad, match in ((dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                       (dict(use_bidirectional_attention=True), "use_bidirectional_attention")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(dict(raw, **bad))


# -- distributed -----------------------------------------------------------------------------------------------

CASES = [
    ("tp2 padded, step on logits, breaks", dict(tp=2), dict(), "logits"),
    ("tp2 packed+SP, logprobs+entropy, step on them", dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
    ("pp2 padded mb2, step on logits, breaks", dict(pp=2, nmb=2), dict(), "logits"),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats"),
]


def make_cases(tmp_path):
    return [layout_harness.make_case(name, make_model(seed=60 + i), tmp_path, i,
                                     *helpers.padded_batch(101, batch=4, seq=SEQ, seed=i), layout=layout,
                                     build=build, loss_on=loss_on, breaks=loss_on == "logits")
            for i, (name, layout, build, loss_on) in enumerate(CASES)]


def _breaks(chunks, case) -> dict:
    import parallm
    from parallm.model.decoder import DecoderLayer
    ids, mask, out = case["ids"], case["mask"], {}
    layers = [m for c in chunks for m in c.modules() if isinstance(m, DecoderLayer)]
    kept = [(m.attn_out_norm, m.rope) for m in layers]
    spec = chunks[0].spec
    for key in ("attn_out_norm", "rope", "cap"):
        for m, (norm, rope) in zip(layers, kept):
            if key == "attn_out_norm":
                m.attn_out_norm = torch.nn.Identity()
            elif key == "rope":
                m.rope = spec.rope                  # every layer on the full layers' RoPE
        if key == "cap":
            for c in chunks:
                c.spec = dataclasses.replace(spec, final_logit_softcap=None)
        try:
            out[key] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
        finally:
            for m, (norm, rope) in zip(layers, kept):
                m.attn_out_norm, m.rope = norm, rope
            for c in chunks:
                c.spec = spec
    return out


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(600)
def test_gemma3_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    layout_harness.check(cases, results, tol=TOL, break_min=1e-2)
    for key in ("break_attn_out_norm", "break_rope", "break_cap"):       # every break measured where asked for
        assert all(key in results[0][i] for i, c in enumerate(cases) if c["breaks"]), key
