"""Gemma 4 text as the released checkpoints run it (issue 57 item 2, docs/families.md "Gemma 4"), against
transformers 5.25's ``Gemma4ForCausalLM`` in fp32, through tests/layout_harness.py.

The tiny model is test_gemma4.py's (4 layers sliding / full / sliding / full, window 4, proportional RoPE on the full
layers, softmax scale 1, v_norm, sandwich norms, q / k norms around 0.5, soft-cap 0.5, tied embeddings, layer
scalars U(0.5, 1.5)) with the released checkpoints' features switched on:

* the full layers' own attention shape: ``global_head_dim`` 32 over ``num_global_key_value_heads`` 1 (the
  sliding layers 16 over 2; at tp2 the one global KV head is replicated), their proportional RoPE over 32;
* K = V on the full layers (``attention_k_eq_v``: no ``v_proj``);
* per-layer input embeddings (``hidden_size_per_layer_input`` 16: ``embed_tokens_per_layer [101, 64]``, the model
  projection and its norm, each layer's gate / projection / norm; at pp2 they cross the stage boundary).

Without a process group: config -> spec and the table against ``save_pretrained``'s names. One 2-rank spawn: tp2
padded, tp2 packed + SP (a step on log-probs + entropy), pp2 mb2, cp2 packed; breaks at tp2 and pp2 (each must
move the logits): the cap off, no v_norm (on the K = V layers the values are the raw keys), every layer on the
sliding layers' RoPE, the per-layer inputs skipped (every layer's term; at pp2 the first stage's are still sent).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers
import layout_harness
from test_gemma4 import GEMMA4

TOL = 2e-5
SEQ = 12
FEATURES = dict(attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=101)


def features_config(**overrides):
    import transformers
    base = {k: v for k, v in GEMMA4.items() if k != "per_layer_config"}
    return transformers.Gemma4TextConfig(**dict(base, **dict(FEATURES, **overrides)))


def make_model(seed: int, **overrides):
    import transformers
    model = transformers.Gemma4ForCausalLM(features_config(**overrides))
    helpers.randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():       # transformers' layer scalars are ones: make ignoring them visible
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():     # q / k norm gains around 0.5 (test_gemma4.py says why)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
    return model.eval()


def test_spec_and_table(tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    spec, family = spec_from_config(features_config())
    assert family.name == "gemma4" and spec.global_layers == (1, 3) and spec.global_k_eq_v
    assert (spec.head_dim, spec.num_kv_heads, spec.global_head_dim, spec.global_kv_heads) == (16, 2, 32, 1)
    assert spec.rope.dim == 32 and spec.layer_rope(0).dim == 16 and spec.kv_head_counts == (1, 2)
    assert spec.per_layer_input_size == 16 and spec.per_layer_input_width == 64 and spec.boundary_width == 128
    hub = helpers.hub_state_dict(make_model(0), str(tmp_path / "m"))
    assert "model.layers.1.self_attn.v_proj.weight" not in hub and "model.layers.0.self_attn.v_proj.weight" in hub
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    # K = V with the sliding layers' shape: the full layers are still K = V layers (their own rows)
    same = spec_from_config(features_config(global_head_dim=16, num_global_key_value_heads=2))[0]
    assert same.global_layers == (1, 3) and same.global_k_eq_v and same.global_head_dim == 16


CASES = [
    ("tp2 padded, step on logits, breaks", dict(tp=2), dict(), "logits"),
    ("tp2 packed+SP, logprobs+entropy, step on them", dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
    ("pp2 padded mb2, step on logits, breaks", dict(pp=2, nmb=2), dict(), "logits"),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats"),
]


def make_cases(tmp_path):
    return [layout_harness.make_case(name, make_model(seed=90 + i), tmp_path, i,
                                     *helpers.padded_batch(101, batch=4, seq=SEQ, seed=i), layout=layout,
                                     build=build, loss_on=loss_on, breaks=loss_on == "logits")
            for i, (name, layout, build, loss_on) in enumerate(CASES)]


class SkipPerLayer(torch.nn.Module):
    """A break: the layer's per-layer input term left out."""

    def forward(self, x, inputs):
        return x


def _breaks(chunks, case) -> dict:
    import parallm
    from parallm.model.decoder import DecoderLayer
    ids, mask, out = case["ids"], case["mask"], {}
    layers = [m for c in chunks for m in c.modules() if isinstance(m, DecoderLayer)]
    kept = [(m.rope, m.self_attention.v_norm_eps, m.per_layer) for m in layers]
    spec = chunks[0].spec
    for key in ("cap", "v_norm", "rope", "per_layer"):
        for m in layers:
            if key == "v_norm":
                m.self_attention.v_norm_eps = None
            elif key == "rope":
                m.rope = spec.layer_rope(0)         # every layer on the sliding layers' RoPE
            elif key == "per_layer":
                m.per_layer = SkipPerLayer()
        if key == "cap":
            for c in chunks:
                c.spec = dataclasses.replace(spec, final_logit_softcap=None)
        try:
            out[key] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
        finally:
            for m, (rope, eps, per_layer) in zip(layers, kept):
                m.rope, m.self_attention.v_norm_eps, m.per_layer = rope, eps, per_layer
            for c in chunks:
                c.spec = spec
    return out


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(600)
def test_gemma4_features_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    layout_harness.check(cases, results, tol=TOL, break_min=1e-2)
    for key in ("break_cap", "break_v_norm", "break_rope", "break_per_layer"):       # every break measured where asked for
        assert all(key in results[0][i] for i, c in enumerate(cases) if c["breaks"]), key
